"""MMEngine's auto-resume (``resume = True`` without ``load_from``), complete checkpoints only.

MMEngine 0.10.6 resumes from what ``last_checkpoint`` names. :func:`resume_from` keeps that
when it is complete, resumes from the newest complete checkpoint beside it otherwise (a warning
names both), and refuses a ZeRO checkpoint written by another number of processes
(``world.refuse_other_world_size``). ``compat.runner_checkpoints`` hands it MMEngine's answer.
"""

from __future__ import annotations

import logging
import os

from mmengine.logging import print_log

from .complete import checkpoint_number, judge_checkpoint, newest_complete, numbered_checkpoints
from .world import refuse_other_world_size


def _warn(message: str) -> None:
    print_log(f"xtuner-rope: auto-resume: {message}", logger="current", level=logging.WARNING)


def _warn_newer_incomplete(latest: str) -> None:
    """Warn about the incomplete checkpoints beside ``latest`` with a higher number: a process
    killed while writing one (a DeepSpeed folder with some ranks' files) never got to update
    ``last_checkpoint``; auto-resume takes ``latest`` and says what it skipped and why."""
    named = checkpoint_number(latest)
    if not named:
        return
    folder = os.path.dirname(os.path.normpath(latest))
    for number, path in numbered_checkpoints(folder, named[0]):
        verdict = judge_checkpoint(path) if number > named[1] else None
        if verdict is not None and not verdict.complete:
            _warn(
                f"skipped {verdict.path}, newer than {latest} but incomplete ({verdict.reason}): "
                f"a run killed while writing it leaves such a checkpoint. Resuming from "
                f"{latest}; the skipped one is overwritten when training reaches it again."
            )


def resume_from(latest: str | None, work_dir: str) -> str | None:
    """The checkpoint auto-resume loads: ``latest`` (``find_latest_checkpoint(work_dir)``:
    None without ``last_checkpoint``, ``""`` when empty) when complete, else the newest complete
    checkpoint in its folder, else None (a fresh start).

    Raises:
        WorldSizeMismatchError: ``latest`` is a ZeRO checkpoint of another number of processes.
    """
    if latest is None or (latest and judge_checkpoint(latest).complete):
        if latest:
            refuse_other_world_size(latest)
            _warn_newer_incomplete(latest)
        return latest
    verdict = judge_checkpoint(latest) if latest else None
    named = checkpoint_number(latest) if latest else None
    # A pointer cut short names no checkpoint: look in the work dir (MMEngine's default out_dir).
    folder = os.path.dirname(os.path.normpath(latest)) if named else work_dir
    instead = newest_complete(folder, named[0] if named else "iter", exclude=latest or None)
    what = f"{latest} is incomplete ({verdict.reason})" if verdict else "it is empty"
    _warn(
        f"{os.path.join(work_dir, 'last_checkpoint')} names a checkpoint that cannot be resumed: "
        f"{what}. "
        + (
            f"Resuming from the newest complete checkpoint, {instead}."
            if instead
            else "No complete checkpoint is there: training starts from the beginning."
        )
    )
    return instead


__all__ = ["resume_from"]
