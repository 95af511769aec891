"""A ZeRO checkpoint resumed on another number of processes is refused before it loads.

Folders are laid out as DeepSpeed 0.19 writes them (``tests/support/deepspeed_folders.py``); the
refusal is checked through the reader ``xtuner train --resume`` really calls first (XTuner's
seed reader) and MMEngine's auto-resume finder. The end-to-end refusal (a real ``xtuner train
--resume`` of a 2-process ZeRO-2 checkpoint on one process) is in
``tests/integration/test_resume.py``.
"""

from __future__ import annotations

import pytest
import torch
import xtuner.tools.utils as xtuner_tool_utils
from deepspeed_folders import deepspeed_folder
from mmengine.runner import checkpoint as mm_checkpoint

from xtuner_rope.checkpoints.world import (
    WorldSizeMismatchError,
    current_world_size,
    refuse_other_world_size,
    saved_world_size,
)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_checkpoint_of_two_processes_refused_on_one(tmp_path, monkeypatch, stage):
    folder = tmp_path / "iter_8.pth"
    deepspeed_folder(folder, 2, [0, 1], stage=stage)
    assert saved_world_size(str(folder)) == (2, stage)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(
        WorldSizeMismatchError,
        match=rf"refused to resume {folder}: it is a DeepSpeed ZeRO-{stage} checkpoint written "
        r"by 2 data-parallel processes .* this run has 1 \(WORLD_SIZE=1\)\. .*Resume on 2 "
        rf"processes: NPROC_PER_NODE=2 xtuner train CONFIG .*--resume {folder} .*"
        rf"python -m deepspeed.utils.zero_to_fp32 {tmp_path} {tmp_path / 'iter_8_fp32'} "
        r"--tag iter_8\.pth, then train without --resume and with --cfg-options "
        rf"load_from={tmp_path / 'iter_8_fp32' / 'pytorch_model.bin'}\.$",
    ):
        xtuner_tool_utils.get_seed_from_checkpoint(str(folder))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(WorldSizeMismatchError, match="this run has 4"):
        refuse_other_world_size(str(folder))


def test_same_number_of_processes_plain_files_and_zero0_pass(tmp_path, monkeypatch):
    deepspeed_folder(tmp_path / "iter_4.pth", 2, [0, 1])
    refuse_other_world_size(str(tmp_path / "iter_4.pth"), world_size=2)
    deepspeed_folder(tmp_path / "iter_6.pth", 2, [], stage=0)  # no partitioned optimizer
    refuse_other_world_size(str(tmp_path / "iter_6.pth"), world_size=1)
    torch.save({"meta": {"seed": 7}, "state_dict": {}}, tmp_path / "iter_2.pth")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert current_world_size() == 1
    assert xtuner_tool_utils.get_seed_from_checkpoint(str(tmp_path / "iter_2.pth")) == 7


def test_auto_resume_refuses_it_too(tmp_path, monkeypatch):
    deepspeed_folder(tmp_path / "iter_4.pth", 2, [0, 1])
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / "iter_4.pth"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert mm_checkpoint.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter_4.pth")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(WorldSizeMismatchError, match="written by 2 data-parallel processes"):
        mm_checkpoint.find_latest_checkpoint(str(tmp_path))
