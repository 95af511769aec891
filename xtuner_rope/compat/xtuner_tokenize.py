"""XTuner's tokenize step swapped for one call (``xtuner_rope.data.truncation``)."""

from __future__ import annotations

import contextlib

from .guard import require
from .records import RECORDS


@contextlib.contextmanager
def xtuner_tokenize_step(wrap):
    """Run XTuner's ``process_hf_dataset`` with ``wrap(tokenize_dataset)`` as its tokenize step.

    xtuner 0.2.0 ``xtuner.dataset.huggingface.process`` tokenizes through the module's
    ``tokenize_dataset``, whose ``encode_fn`` cuts every dialogue at ``max_length`` and says
    nothing (57 of 200 pretraining documents, 29% of their tokens, on a stock config at
    ``max_length`` 512). Used only by ``xtuner_rope.data.truncation.counting_truncation``, which
    counts what the cut loses (and keeps pretraining documents whole for the packer to split);
    XTuner's function is restored on exit. ``LLaVADataset`` and the other builders that call
    ``process_hf_dataset`` go through the same step.

    Args:
        wrap: Called with XTuner's ``tokenize_dataset``; returns the function to use instead
            (same arguments).
    """
    require(RECORDS["xtuner_tokenize_step"])  # skipped here: refuse, never cut uncounted
    import xtuner.dataset.huggingface as hf

    original = hf.tokenize_dataset
    hf.tokenize_dataset = wrap(original)
    try:
        yield
    finally:
        hf.tokenize_dataset = original
