"""A checkpoint cut short is judged incomplete and refused before it loads, naming the complete one.

Files are written by ``torch.save`` (zip format, as MMEngine writes them; the legacy format too)
and cut as a crash or a full disk cuts them. The refusal is checked through the loaders
``xtuner train --resume`` really calls: XTuner's seed reader and MMEngine's ``CheckpointLoader``.
The end-to-end refusal (a real ``xtuner-rope train --resume``) is
``tests/integration/test_checkpoint_crash.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xtuner.tools.utils as xtuner_tool_utils
from deepspeed_folders import deepspeed_folder
from mmengine.runner.checkpoint import CheckpointLoader

from xtuner_rope.checkpoints.complete import (
    IncompleteCheckpointError,
    judge_checkpoint,
    newest_complete,
)


def _checkpoint(iteration: int) -> dict:
    return {
        "meta": {"seed": 1234, "iter": iteration},
        "state_dict": {"w": torch.randn(64, 64), "b": torch.randn(64)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(64, 64)}}},
    }


def _cut(path, keep: float | int) -> None:
    """Keep the first ``keep`` bytes (an int) or that share of the file (a float)."""
    data = path.read_bytes()
    path.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
@pytest.mark.parametrize("keep", [0, 0.1, 0.5, 0.9, -1], ids=lambda k: f"keep={k}")
def test_a_cut_file_is_incomplete_and_the_whole_file_complete(tmp_path, legacy, keep):
    path = tmp_path / "iter_8.pth"
    torch.save(_checkpoint(8), path, _use_new_zipfile_serialization=not legacy)
    assert judge_checkpoint(str(path)).complete
    _cut(path, keep)
    verdict = judge_checkpoint(str(path))
    assert not verdict.complete
    assert f"{path.stat().st_size} bytes" in verdict.reason, verdict.reason


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_every_cut_of_a_runner_checkpoint_is_incomplete(tmp_path, legacy):
    """Cuts every 61 bytes, through the pickles (message hub, numpy scalars) and the storages."""
    from mmengine.logging import MessageHub

    hub = MessageHub.get_instance("test_every_cut")
    hub.update_scalar("train/loss", np.float64(2.5))
    whole, cut = tmp_path / "whole.pth", tmp_path / "iter_8.pth"
    torch.save(
        {**_checkpoint(8), "message_hub": hub.state_dict()},
        whole,
        _use_new_zipfile_serialization=not legacy,
    )
    data = whole.read_bytes()
    judged_complete = []
    for keep in [*range(1, len(data), 61), len(data) - 1]:
        cut.write_bytes(data[:keep])
        if judge_checkpoint(str(cut)).complete:
            judged_complete.append(keep)
    assert not judged_complete
    assert judge_checkpoint(str(whole)).complete


def test_other_bytes_and_missing_files_are_incomplete(tmp_path):
    path = tmp_path / "iter_2.pth"
    path.write_bytes(b"not a checkpoint at all")
    assert "neither torch.save's zip format" in judge_checkpoint(str(path)).reason
    assert judge_checkpoint(str(tmp_path / "gone.pth")).reason == "it does not exist"


def test_newest_complete_skips_cut_files_and_orders_by_iteration(tmp_path):
    for it in (2, 4, 10, 12):
        torch.save(_checkpoint(it), tmp_path / f"iter_{it}.pth")
    _cut(tmp_path / "iter_12.pth", 0.5)
    _cut(tmp_path / "iter_10.pth", -30)  # only the end of its central directory missing
    (tmp_path / ".iter_14.pth.77.tmp").write_bytes(b"")  # an atomic write in progress
    torch.save(_checkpoint(6), tmp_path / "epoch_6.pth")
    assert newest_complete(str(tmp_path)) == str(tmp_path / "iter_4.pth")
    assert newest_complete(str(tmp_path), "epoch") == str(tmp_path / "epoch_6.pth")
    assert newest_complete(str(tmp_path), exclude=str(tmp_path / "iter_4.pth")).endswith(
        "iter_2.pth"
    )
    assert newest_complete(str(tmp_path / "nowhere")) is None


@pytest.mark.parametrize(
    "load",
    [
        xtuner_tool_utils.get_seed_from_checkpoint,
        lambda p: CheckpointLoader.load_checkpoint(p, map_location="cpu"),
    ],
    ids=["xtuner-seed-reader", "mmengine-loader"],
)
def test_resume_of_a_cut_checkpoint_is_refused_naming_the_complete_one(tmp_path, load):
    for it in (4, 8):
        torch.save(_checkpoint(it), tmp_path / f"iter_{it}.pth")
    newest = tmp_path / "iter_8.pth"
    _cut(newest, 0.5)
    size = newest.stat().st_size
    with pytest.raises(
        IncompleteCheckpointError,
        match=rf"refused to load {newest}: the checkpoint is incomplete \({size} bytes without "
        r"the zip central directory .* resume with --resume "
        rf"{tmp_path / 'iter_4.pth'}\.$",
    ):
        load(str(newest))
    os.remove(tmp_path / "iter_4.pth")
    with pytest.raises(IncompleteCheckpointError, match="train again without --resume"):
        load(str(newest))


def test_a_deepspeed_folder_needs_every_rank_and_whole_files(tmp_path):
    deepspeed_folder(tmp_path / "iter_4.pth", 2, [0, 1])
    assert judge_checkpoint(str(tmp_path / "iter_4.pth")).complete
    deepspeed_folder(tmp_path / "iter_8.pth", 2, [0])
    assert "optim states of data-parallel rank(s) [1] missing: expected 2" in (
        judge_checkpoint(str(tmp_path / "iter_8.pth")).reason
    )
    deepspeed_folder(tmp_path / "iter_12.pth", 2, [0, 1])
    _cut(tmp_path / "iter_12.pth" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", 0.5)
    assert judge_checkpoint(str(tmp_path / "iter_12.pth")).reason.startswith(
        "zero_pp_rank_1_mp_rank_00_optim_states.pt is incomplete"
    )
    (tmp_path / "iter_16.pth").mkdir()
    assert "no *mp_rank_*_model_states.pt" in judge_checkpoint(str(tmp_path / "iter_16.pth")).reason
    deepspeed_folder(tmp_path / "iter_20.pth", 2, [], stage=1)  # no optimizer file at all
    assert "rank(s) [0, 1] missing" in judge_checkpoint(str(tmp_path / "iter_20.pth")).reason
    assert newest_complete(str(tmp_path)) == str(tmp_path / "iter_4.pth")
    with pytest.raises(IncompleteCheckpointError, match=r"--resume \S+iter_4\.pth"):
        xtuner_tool_utils.get_seed_from_checkpoint(str(tmp_path / "iter_12.pth"))


def test_a_zero3_folder_needs_every_rank_of_model_states(tmp_path):
    deepspeed_folder(tmp_path / "iter_4.pth", 2, [0, 1], stage=3)
    assert judge_checkpoint(str(tmp_path / "iter_4.pth")).complete
    (tmp_path / "iter_4.pth" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    assert "model states of data-parallel rank(s) [1] missing" in (
        judge_checkpoint(str(tmp_path / "iter_4.pth")).reason
    )
