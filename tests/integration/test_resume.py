"""A run stopped at iteration N and resumed with `--resume` continues as if never stopped.

MMEngine resumes iteration-based training by reloading weights, optimizer, scheduler and the
seed from the checkpoint and then skipping the N batches already trained (the sampler is
re-seeded identically and advanced). If any of that were off - another shuffle, no skip,
a fresh optimizer - the losses after N would differ from the uninterrupted run by far more
than the tolerance. CPU fp32 with the same seed and thread count is deterministic, so the
tolerance only absorbs float noise we have not seen (measured difference: 0).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xtuner_rope.demo.runlog import check_run, train_losses

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["configs/tiny_internlm2_short_dialogues.py"]
STOP, TOTAL = 6, 12
LOSS_ATOL = 1e-6
# Per-iteration losses at full precision in vis_data/scalars.json.
LOG_EVERY_ITER = ("default_hooks.logger.interval=1", "log_processor.window_size=1")


def _train(config: str, work_dir: Path, max_iters: int, *extra: str) -> str:
    """`python -m xtuner.tools.train` (which, unlike `xtuner train`, returns 1 on a crash)."""
    cmd = [
        sys.executable,
        "-m",
        "xtuner.tools.train",
        config,
        "--work-dir",
        str(work_dir),
        *extra,
        "--cfg-options",
        "train_cfg.max_epochs=None",
        f"train_cfg.max_iters={max_iters}",
        *LOG_EVERY_ITER,
    ]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_resume_continues_the_same_run(config, tmp_path):
    stopped, resumed, straight = tmp_path / "stopped", tmp_path / "resumed", tmp_path / "straight"

    _train(config, stopped, STOP)
    checkpoint = check_run(stopped, min_iters=STOP).checkpoint
    assert checkpoint.name == f"iter_{STOP}.pth"

    output = _train(config, resumed, TOTAL, "--resume", str(checkpoint))
    assert re.search(rf"resumed epoch: \d+, iter: {STOP}", output), output[-4000:]
    check_run(resumed, min_iters=TOTAL)
    resumed_iters, resumed_losses = train_losses(resumed)
    # Training went on from N + 1: nothing before it was trained (or logged) again.
    assert resumed_iters == list(range(STOP + 1, TOTAL + 1))

    _train(config, straight, TOTAL)
    straight_iters, straight_losses = train_losses(straight)
    assert straight_iters == list(range(1, TOTAL + 1))

    # The first N iterations are reproducible, and so is everything after the resume.
    assert train_losses(stopped)[1] == pytest.approx(straight_losses[:STOP], abs=LOSS_ATOL)
    assert resumed_losses == pytest.approx(straight_losses[STOP:], abs=LOSS_ATOL), (
        f"resumed: {resumed_losses}\nuninterrupted: {straight_losses[STOP:]}"
    )
    # The comparison has teeth: the losses after N move by much more than the tolerance.
    assert max(straight_losses[STOP:]) - min(straight_losses[STOP:]) > 1000 * LOSS_ATOL
