"""`xtuner_zero_read.patch_xtuner_zero_read_fp32`: XTuner's ZeRO checkpoint reader defaults to fp32.

The reads of a real ZeRO-2 checkpoint, bit for bit against the module DeepSpeed saved, are in
tests/integration/test_resume.py (they share its 2-process run); here the patch's state and its
version guard.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import xtuner_rope  # noqa: F401  (applies the compat patches)
from xtuner_rope.compat import guard, records
from xtuner_rope.compat.xtuner_zero_read import (
    ZERO_READ_FEATURE,
    ZERO_READER_FUNCTIONS,
    ZERO_READER_MODULE,
    patch_xtuner_zero_read_fp32,
)


def test_reader_defaults_to_fp32_once_the_plugin_is_loaded():
    reader = pytest.importorskip(ZERO_READER_MODULE)
    assert reader.DEFAULT_DTYPE is torch.float32
    for name in ZERO_READER_FUNCTIONS:
        assert getattr(reader, name).__defaults__[-1] is torch.float32, name
    assert not patch_xtuner_zero_read_fp32()  # applied once: no gap left


def test_a_reader_not_as_xtuner_0_2_0_wrote_it_is_skipped_with_a_warning(monkeypatch):
    """The guard judges it (one ``CompatPatchSkipped``), whatever the way it differs."""
    record = records.RECORDS["patch_xtuner_zero_read_fp32"]
    changed = types.ModuleType(ZERO_READER_MODULE)
    changed.DEFAULT_DTYPE = torch.float16
    changed.get_state_dict_from_zero_checkpoint = lambda checkpoint_dir, dtype=None: None
    monkeypatch.setitem(sys.modules, ZERO_READER_MODULE, changed)
    monkeypatch.setattr(guard, "_OUTCOMES", {})
    with pytest.warns(guard.CompatPatchSkipped, match="read at fp32.*no float16 default dtype"):
        assert not guard.run_guarded(record, patch_xtuner_zero_read_fp32)
    assert changed.DEFAULT_DTYPE is torch.float16  # nothing half-patched
    del changed.DEFAULT_DTYPE
    monkeypatch.setattr(guard, "_OUTCOMES", {})
    with pytest.warns(guard.CompatPatchSkipped, match="DEFAULT_DTYPE is missing"):
        assert not guard.run_guarded(record, patch_xtuner_zero_read_fp32)
    assert ZERO_READ_FEATURE.startswith("xtuner-rope's exact read")
