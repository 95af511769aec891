"""Checkpoints at accumulation-window boundaries: a resume equals the uninterrupted run.

With ``accumulative_counts = K`` the optimizer steps after iterations K, 2K, ... (MMEngine's
``OptimWrapper`` counts windows from iteration 0, across epochs; DeepSpeed counts its micro-steps
the same way). A checkpoint written inside a window holds the weights of the last step but not
the gradients accumulated since: neither MMEngine nor DeepSpeed saves them, and MMEngine only
warns on resume ("the gradient of some iterations is lost"). Measured before this module: a
tiny-recipe run resumed from a mid-window checkpoint ended 9.4e-3 away from the uninterrupted run.

Design: the checkpoints land only where no gradient is pending, so there is nothing to save.

- start-up (:func:`checkpoint_interval_findings`, a fix, logged): the iteration-based
  ``CheckpointHook`` interval (and ``save_begin``) is raised to the next multiple of
  ``accumulative_counts`` (XTuner's stock ``save_steps = 500`` with ``accumulative_counts = 16``
  becomes 512). A run killed at any iteration is resumed from its newest checkpoint, at a window
  boundary, and continues as if never stopped.
- every iteration (:func:`record_window`, from ``TokenWeightedLossHook.after_train_iter``, before
  ``CheckpointHook`` saves): whether a window is open is written to the message hub, which both
  MMEngine's and DeepSpeed's checkpoints carry (checkpoints at epoch ends and at the last
  iteration are not aligned by the start-up: the record says whether they are mid-window).
- resume (:func:`check_resume`, from ``TokenWeightedLossHook.before_train``, before any step):
  a checkpoint written inside an open window (by this plugin's record, or for a checkpoint
  without a record, an iteration that is not a multiple of ``accumulative_counts``) is refused
  with the checkpoints that work; ``resume_mid_window = True`` in the config resumes anyway
  (MMEngine's behaviour: the open window's gradients are lost).
"""

from __future__ import annotations

import math

from mmengine.logging import print_log

from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.config.fields import type_name
from xtuner_rope.config.findings import Finding
from xtuner_rope.config.startup import register_findings

WINDOW_KEY = "xtuner_rope.accumulation_window"  # message-hub key: {"counts": K, "open": bool}
RESUME_ANYWAY_KEY = "resume_mid_window"  # top-level config key: resume a mid-window checkpoint


class MidWindowResumeError(RuntimeError):
    """A resume from a checkpoint written inside an open accumulation window."""


def _accumulative_counts(cfg_dict: dict) -> int:
    """``optim_wrapper.accumulative_counts``, or a DeepSpeed strategy's own accumulation."""
    for part, key in (
        ("optim_wrapper", "accumulative_counts"),
        ("strategy", "gradient_accumulation_steps"),
    ):
        node = dict.get(cfg_dict, part)
        counts = node.get(key) if isinstance(node, dict) else None
        if isinstance(counts, int) and not isinstance(counts, bool) and counts > 1:
            return counts
    return 1


@register_findings("checkpoint_saving")
def checkpoint_interval_findings(cfg) -> list[Finding]:
    """Start-up fix: iteration checkpoints at multiples of ``accumulative_counts``.

    Args:
        cfg: The config (lazy objects unbuilt).

    Returns:
        One fix per ``default_hooks.checkpoint`` setting (``interval``, ``save_begin``) that is
        not a multiple of ``optim_wrapper.accumulative_counts``; none for epoch checkpoints.
    """
    counts = _accumulative_counts(config_dict(cfg))
    hooks = dict.get(config_dict(cfg), "default_hooks")
    hook = hooks.get("checkpoint") if isinstance(hooks, dict) else None
    if counts <= 1 or not isinstance(hook, dict):
        return []
    if not type_name(hook.get("type", "CheckpointHook")).endswith("CheckpointHook"):
        return []
    if hook.get("by_epoch", True):  # MMEngine's default: epoch checkpoints (len unknown here)
        return []
    findings = []
    for key, default in (("interval", -1), ("save_begin", 0)):
        value = hook.get(key, default)
        if not isinstance(value, int) or value <= 0 or value % counts == 0:
            continue
        aligned = math.ceil(value / counts) * counts

        def align(key=key, aligned=aligned) -> None:
            hook[key] = aligned

        findings.append(
            Finding(
                f"default_hooks.checkpoint.{key}",
                f"{value} iterations is not a multiple of accumulative_counts={counts}: its "
                "checkpoints would land inside an accumulation window, whose gradients no "
                "checkpoint holds (a resume from one would lose them)",
                f"set to {aligned} (the next multiple of {counts}): every checkpoint at a window "
                "boundary, so a resume equals the uninterrupted run",
                align,
            )
        )
    return findings


def accumulation_state(optim_wrapper) -> tuple[int, bool]:
    """``(accumulative_counts, window open)`` of an optimizer wrapper after an iteration.

    Args:
        optim_wrapper: MMEngine's ``OptimWrapper`` (and subclasses) or ``DeepSpeedOptimWrapper``
            whose ``update_params`` ran this iteration.

    Returns:
        The window length and whether gradients are pending (the iteration did not step).
    """
    engine = getattr(optim_wrapper, "model", None)
    if type(optim_wrapper).__name__ == "DeepSpeedOptimWrapper" and engine is not None:
        counts = int(engine.gradient_accumulation_steps())
        return counts, engine.micro_steps % counts != 0  # step() counted this micro-step
    counts = int(getattr(optim_wrapper, "_accumulative_counts", 1))
    should_update = getattr(optim_wrapper, "should_update", None)
    return counts, bool(counts > 1 and should_update is not None and not should_update())


def record_window(runner) -> None:
    """Write this iteration's window state to the message hub (saved with every checkpoint)."""
    counts, open_ = accumulation_state(runner.optim_wrapper)
    runner.message_hub.update_info(WINDOW_KEY, {"counts": counts, "open": open_})


def check_resume(runner) -> None:
    """Refuse to continue from a checkpoint written inside an open accumulation window.

    Call in ``before_train``: after MMEngine resumed (``runner.iter`` is the checkpoint's
    iteration, the message hub the checkpoint's), before the first step.

    Raises:
        MidWindowResumeError: the checkpoint's window was open (its record), or it has no record
            and its iteration is not a multiple of the run's ``accumulative_counts``.
    """
    done = getattr(runner, "iter", 0)  # a runner stand-in of a unit test may have none
    if done == 0:
        return  # a fresh run (``load_from`` loads weights only)
    counts = accumulation_state(runner.optim_wrapper)[0]
    record = runner.message_hub.get_info(WINDOW_KEY)
    if isinstance(record, dict):
        open_, saved_counts = bool(record.get("open")), record.get("counts", counts)
    else:
        open_, saved_counts = done % counts != 0, counts
    if not open_:
        if done % counts:
            print_log(
                f"xtuner-rope: resumed at iteration {done}, after a closed window (the end of "
                f"its run); with accumulative_counts={counts} the first window is "
                f"{counts - done % counts} iteration(s) long.",
                logger="current",
            )
        return
    if runner.cfg.get(RESUME_ANYWAY_KEY, False) if hasattr(runner.cfg, "get") else False:
        print_log(
            f"xtuner-rope: {RESUME_ANYWAY_KEY} = True: resuming at iteration {done}, inside an "
            f"accumulation window of {saved_counts}; the gradients of its first "
            f"{done % saved_counts} iteration(s) are lost.",
            logger="current",
            level=30,
        )
        return
    previous = done // saved_counts * saved_counts
    earlier = f"iter_{previous} or earlier" if previous else "none yet: start again"
    raise MidWindowResumeError(
        f"xtuner-rope: --resume from iteration {done}: the checkpoint was written inside an "
        f"accumulation window (accumulative_counts={saved_counts}), and the gradients of its "
        f"{done % saved_counts} micro-batch(es) since iteration {previous} are in no checkpoint "
        "(MMEngine and DeepSpeed save none): the resumed run would not equal the uninterrupted "
        f"one. Resume from a checkpoint at a multiple of {saved_counts} ({earlier}; with "
        "xtuner-rope's start-up every iteration checkpoint is one), or set "
        f"{RESUME_ANYWAY_KEY} = True at the top of the config to resume anyway and lose them."
    )


__all__ = [
    "MidWindowResumeError",
    "accumulation_state",
    "check_resume",
    "checkpoint_interval_findings",
    "record_window",
]
