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
    ``process_hf_dataset`` go through the same step, and so does the intern-repo untokenized
    loader (``process``, one call per file; counted by ``build_whole_packed_dataset``).

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


def patch_xtuner_tokenize_counted(counted_step) -> bool:
    """Count and log XTuner's cut at ``max_length`` on the builds no start-up fix routes.

    xtuner 0.2.0 ``process_hf_dataset`` with ``pack_to_max_length=False`` (and ``LLaVADataset``,
    which calls it for its text) keeps the first ``max_length`` tokens of every dialogue and
    says nothing; the start-up replaces only the packing builds. The module's
    ``tokenize_dataset`` is wrapped for the process by ``counted_step``
    (``xtuner_rope.data.truncation.counted_tokenize_step``, handed in by
    ``xtuner_rope.activate``: ``data`` sits above ``compat``): the same dataset, token for
    token, and one start-up line with what the cut lost (none when nothing is cut).

    Args:
        counted_step: ``original -> wrapped`` for XTuner's ``tokenize_dataset``.

    Returns:
        True if the step is wrapped (now or before).
    """
    import xtuner.dataset.huggingface as hf

    if not getattr(hf.tokenize_dataset, "_xtuner_rope_counted", False):
        hf.tokenize_dataset = counted_step(hf.tokenize_dataset)
    return True
