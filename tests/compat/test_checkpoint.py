"""Checkpoints load weights-only: runner state passes, anything that could run code is refused.

The loaders under test are the ones ``xtuner train`` really calls: MMEngine's local loader
(``CheckpointLoader``, used by ``--resume`` and ``load_from``) and XTuner's seed reader, both
routed through ``xtuner_rope.checkpoints.loading.load_checkpoint`` by ``compat``. Resume = uninterrupted
through ``xtuner train`` is ``tests/test_resume.py``.
"""

import builtins
import os
import pickle

import numpy as np
import pytest
import torch
import xtuner.tools.utils as xtuner_tool_utils
from mmengine.config import ConfigDict
from mmengine.logging import HistoryBuffer, MessageHub
from mmengine.runner.checkpoint import CheckpointLoader

from xtuner_rope.checkpoints.loading import TRUST_ENV, UntrustedCheckpointError, load_checkpoint


class _RunsCode:
    """Unpickling this calls ``exec``: it creates ``marker`` (a stand-in for any payload)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').close()",)


class _ReachesGlobals:
    """Unpickling this asks ``getattr(HistoryBuffer.min, '__globals__')``: a way to builtins."""

    def __reduce__(self):
        return getattr, (HistoryBuffer.min, "__globals__")


def _runner_checkpoint() -> dict:
    """A checkpoint as MMEngine's runner writes one: message hub with HistoryBuffers holding
    numpy scalars, numpy arrays, config dicts, tensors."""
    hub = MessageHub.get_instance("test_checkpoint")
    for value in (np.float64(2.5), np.float32(1.25), 3):
        hub.update_scalar("train/loss", value)
    hub.update_info("iter", 6)
    return {
        "meta": {
            "seed": 1234,
            "iter": 6,
            "cfg": "model = dict()",
            "dataset_meta": ConfigDict(a=1),
            "flags": {1, 2},
            "lr": np.float64(1e-4),
            "hist": np.arange(4),
            "dtype": np.dtype("int32"),
        },
        "state_dict": {"w": torch.randn(3, 4)},
        "message_hub": hub.state_dict(),
    }


def test_runner_checkpoints_load_through_every_patched_loader(tmp_path):
    path = tmp_path / "iter_6.pth"
    saved = _runner_checkpoint()
    torch.save(saved, path)
    for loaded in (
        load_checkpoint(str(path)),
        CheckpointLoader.load_checkpoint(str(path), map_location="cpu"),
    ):
        assert loaded["meta"]["seed"] == 1234 and loaded["meta"]["dataset_meta"].a == 1
        assert loaded["meta"]["hist"].tolist() == [0, 1, 2, 3]
        torch.testing.assert_close(loaded["state_dict"]["w"], saved["state_dict"]["w"])
        buffer = loaded["message_hub"]["log_scalars"]["train/loss"]
        assert isinstance(buffer, HistoryBuffer) and buffer.mean() == pytest.approx(6.75 / 3)
        assert buffer.statistics("min") == 1.25
    assert xtuner_tool_utils.get_seed_from_checkpoint(str(path)) == 1234


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path, legacy):
    marker, path = tmp_path / "code_ran", tmp_path / "downloaded.pth"
    torch.save(
        {**_runner_checkpoint(), "payload": _RunsCode(marker)},
        path,
        _use_new_zipfile_serialization=not legacy,
    )
    for load in (
        load_checkpoint,
        lambda p: CheckpointLoader.load_checkpoint(p, "cpu"),
        xtuner_tool_utils.get_seed_from_checkpoint,
    ):
        with pytest.raises(
            UntrustedCheckpointError,
            match=rf"refused to load {path}: it names .*\bexec\b.* "
            rf"set {TRUST_ENV}={path} ",
        ):
            load(str(path))
    assert not marker.exists()


def test_getattr_reaches_only_history_buffer_methods(tmp_path):
    path = tmp_path / "escape.pth"
    torch.save({"meta": {"seed": 1}, "x": _ReachesGlobals()}, path)
    with pytest.raises(
        UntrustedCheckpointError,
        match=r"getattr\(<function HistoryBuffer\.min"
        r".*'__globals__'\)",
    ):
        load_checkpoint(str(path))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)  # and torch itself allows no getattr at all


def test_a_trusted_file_or_folder_loads_fully(tmp_path, monkeypatch):
    marker, path = tmp_path / "code_ran", tmp_path / "runs" / "mine.pth"
    path.parent.mkdir()
    torch.save({"meta": {"seed": 7}, "payload": _RunsCode(marker)}, path)
    monkeypatch.setenv(TRUST_ENV, os.pathsep.join(["/nonexistent", str(tmp_path / "ru")]))
    with pytest.raises(UntrustedCheckpointError):  # a name prefix is not a folder
        load_checkpoint(str(path))
    monkeypatch.setenv(TRUST_ENV, os.pathsep.join(["/nonexistent", str(path.parent)]))
    assert load_checkpoint(str(path))["meta"]["seed"] == 7
    assert marker.exists()  # trusted: unpickled in full, as the user asked
