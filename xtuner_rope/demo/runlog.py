"""Read what an ``xtuner train`` run produced (its exit code cannot be trusted): losses,
checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunSummary:
    """Training losses by iteration and the newest checkpoint of one work dir."""

    iters: list[int]
    losses: list[float]
    checkpoint: Path


def train_losses(work_dir: str | Path) -> tuple[list[int], list[float]]:
    """Iterations and losses logged by the newest run in ``work_dir`` (empty if none)."""
    runs = sorted(Path(work_dir).glob("*/vis_data/scalars.json"))
    iters, losses = [], []
    if runs:
        for line in filter(str.strip, runs[-1].read_text().splitlines()):
            record = json.loads(line)
            if "loss" in record and "iter" in record:
                iters.append(int(record["iter"]))
                losses.append(float(record["loss"]))
    return iters, losses


def check_run(work_dir: str | Path, min_iters: int = 1) -> RunSummary:
    """Summarise a finished run in ``work_dir``, or raise if it did not train ``min_iters`` and save.

    Raises:
        RuntimeError: no loss logged, too few iterations, a non-finite loss or no checkpoint;
            the message points at the run's log.
    """
    work_dir = Path(work_dir)
    logs = sorted(work_dir.glob("*/*.log"))
    where = f"see {logs[-1]}" if logs else f"no log under {work_dir}"
    iters, losses = train_losses(work_dir)
    if not iters or iters[-1] < min_iters:
        raise RuntimeError(
            f"training logged iterations {iters[-3:]} (expected up to at least "
            f"{min_iters}): it crashed or never started; {where}"
        )
    if any(loss != loss or loss in (float("inf"), float("-inf")) for loss in losses):
        raise RuntimeError(f"non-finite training loss {losses}; {where}")
    pointer = work_dir / "last_checkpoint"
    checkpoint = Path(pointer.read_text().strip()) if pointer.is_file() else None
    if checkpoint is None or not checkpoint.exists():
        raise RuntimeError(f"no checkpoint saved in {work_dir}; {where}")
    return RunSummary(iters, losses, checkpoint)
