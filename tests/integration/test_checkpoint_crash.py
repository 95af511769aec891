"""A checkpoint write that fails, then a checkpoint cut short: real ``xtuner-rope train`` runs.

The tiny recipe (32 dialogues, 4 a step: 8 iterations; a checkpoint every 4; its
``save_total_limit = 1`` keeps one) trains three times in one work dir:

1. the disk fills after iteration 5 (``tests/support/disk_full_hook.py``: a real file size limit),
   so writing ``iter_8.pth`` fails: training stops with a non-zero status and an error naming the
   path and the bytes needed; ``iter_4.pth`` stays complete (MMEngine alone deletes it before
   writing ``iter_8.pth`` and leaves the first bytes of ``iter_8.pth`` under its final name);
2. ``iter_8.pth`` is then made what a crash during ``torch.save`` leaves (the first half of a
   checkpoint of this run) and ``last_checkpoint`` names it: ``--resume iter_8.pth`` exits
   non-zero before any iteration, naming it incomplete and ``--resume .../iter_4.pth``;
3. ``resume = True`` (MMEngine's auto-resume) skips it with a warning, resumes from
   ``iter_4.pth`` and trains to the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import stock_configs as sc

from xtuner_rope.checkpoints.complete import judge_checkpoint
from xtuner_rope.demo.runlog import check_run, train_losses

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"


def _config(tmp: Path) -> Path:
    lines = (REPO / "data" / "short_dialogues.jsonl").read_text(encoding="utf-8").splitlines()
    data = tmp / "first_32.jsonl"
    data.write_text("\n".join(lines[:32]) + "\n", encoding="utf-8")
    text = (REPO / "configs" / "tiny_internlm2_short_dialogues.py").read_text(encoding="utf-8")
    for pattern, new in (
        (r"^batch_size = \d+", "batch_size = 4"),
        (r"^save_steps = \d+", "save_steps = 4"),
        (r'^data_path = ".*"$', f'data_path = "{data}"'),
        (
            r"^(from mmengine.optim import .*\n)",
            r"\g<1>from disk_full_hook import DiskFullAfterIterationHook\n",
        ),
    ):
        text = sc.sub_once(text, pattern, new)
    path = tmp / "tiny.py"
    path.write_text(
        text + "custom_hooks.append(dict(type=DiskFullAfterIterationHook))\n"
        "param_scheduler = []  # constant LR: 8 iterations round the stock warm-up to 0\n"
    )
    return path


def _train(config: Path, work_dir: Path, *args: str, **env: str) -> tuple[int, str]:
    """``xtuner-rope train CONFIG --work-dir W ARGS``: its status and output."""
    environ = dict(sc.venv_env(), PYTHONPATH=os.pathsep.join([str(SUPPORT), str(REPO)]), **env)
    cmd = [
        sys.executable,
        "-m",
        "xtuner_rope.cli",
        "train",
        str(config),
        "--work-dir",
        str(work_dir),
    ]
    proc = subprocess.run(
        [*cmd, *args], cwd=REPO, env=environ, capture_output=True, text=True, timeout=600
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_full_disk_then_cut_checkpoint_refused_and_auto_resume_skips_it(tmp_path):
    config, work = _config(tmp_path), tmp_path / "work"
    kept, cut = work / "iter_4.pth", work / "iter_8.pth"

    status, out = _train(
        config, work, XTUNER_ROPE_DISK_FULL_AT="5", XTUNER_ROPE_DISK_FULL_BYTES="300000"
    )
    need = re.search(rf"could not write checkpoint {cut}: it needs (\d+) bytes", out)
    assert status != 0 and need, (status, out[-4000:])
    assert int(need.group(1)) > 300_000 and f"--resume {kept}" in out
    assert judge_checkpoint(str(kept)).complete and not cut.exists()
    assert (work / "last_checkpoint").read_text() == str(kept)
    print(f"disk full at iter_8: stopped with status {status}, {need.group(1)} bytes needed")

    cut.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2])
    (work / "last_checkpoint").write_text(str(cut))
    status, out = _train(config, work, "--resume", str(cut))
    assert status != 0, out[-4000:]
    message = re.search(r"IncompleteCheckpointError: (.*)", out)
    assert message, out[-4000:]
    assert f"refused to load {cut}: the checkpoint is incomplete" in message.group(1)
    assert message.group(1).endswith(f"resume with --resume {kept}.")
    assert "Iter(train)" not in out  # refused before any iteration
    print(f"--resume of the cut checkpoint: status {status}: {message.group(1)}")

    status, out = _train(config, work, "--cfg-options", "resume=True")
    assert status == 0, out[-4000:]
    assert re.search(
        rf"auto-resume: .* {cut} is incomplete .* newest complete checkpoint, {kept}", out
    )
    assert re.search(r"resumed epoch: \d+, iter: 4", out), out[-4000:]
    done, _ = train_losses(work)
    assert check_run(work, min_iters=8).checkpoint == cut and judge_checkpoint(str(cut)).complete
    print(f"auto-resume: from iter_4, logged iterations {done}")
