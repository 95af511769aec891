"""XTuner's own dataset steps, for live references: the plugin's counting wrappers taken off.

The plugin's activation wraps XTuner's ``tokenize_dataset`` (``xtuner_tokenize.patch_xtuner_tokenize_counted``)
and ``PreferenceDataset`` (``xtuner_preference.patch_preference_truncation_counted``) for the process. A
reference built inside :func:`xtuner_unpatched` is XTuner's, never the plugin's count of it.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def xtuner_unpatched():
    """XTuner's unwrapped tokenize step and preference dataset for the block."""
    import xtuner.dataset.huggingface as hf
    import xtuner.dataset.preference_dataset as pref

    saved = hf.tokenize_dataset, pref.PreferenceDataset
    hf.tokenize_dataset = getattr(hf.tokenize_dataset, "__wrapped__", hf.tokenize_dataset)
    pref.PreferenceDataset = getattr(pref.PreferenceDataset, "xtuner_class", pref.PreferenceDataset)
    assert hf.tokenize_dataset.__code__.co_filename == hf.__file__
    try:
        yield
    finally:
        hf.tokenize_dataset, pref.PreferenceDataset = saved
