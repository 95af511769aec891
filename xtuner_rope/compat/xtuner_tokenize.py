"""XTuner's tokenize step swapped for one call (``xtuner_rope.data.truncation``)."""

from __future__ import annotations

import contextlib

from .guard import require
from .records import RECORDS


@contextlib.contextmanager
def xtuner_tokenize_step(wrap):
    """Run XTuner's ``process_hf_dataset`` with ``wrap(tokenize_dataset)`` as its tokenize step.

    xtuner 0.2.0 tokenizes through ``xtuner.dataset.huggingface.tokenize_dataset``, whose
    ``encode_fn`` cuts every dialogue at ``max_length`` silently. Used by
    ``data.truncation.counting_truncation`` to count the cut; XTuner's function is restored on exit.
    """
    require(RECORDS["xtuner_tokenize_step"])  # skipped here: refuse, never cut uncounted
    import xtuner.dataset.huggingface as hf

    original = hf.tokenize_dataset
    hf.tokenize_dataset = wrap(original)
    try:
        yield
    finally:
        hf.tokenize_dataset = original


def patch_xtuner_tokenize_counted(counted_step) -> bool:
    """Count and log XTuner's cut at ``max_length`` on the builds no start-up fix routes.

    ``process_hf_dataset`` without packing (and ``LLaVADataset``'s text) keeps the first
    ``max_length`` tokens silently. ``tokenize_dataset`` is wrapped by ``counted_step``
    (``data.truncation.counted_tokenize_step``, handed in by ``xtuner_rope.activate``: ``data``
    sits above ``compat``): the same tokens, and one line with what the cut lost.
    """
    import xtuner.dataset.huggingface as hf

    hf.tokenize_dataset = counted_step(hf.tokenize_dataset)  # the guard runs it once
    return True
