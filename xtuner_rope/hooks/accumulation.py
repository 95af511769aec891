"""Checkpoints at accumulation-window boundaries: a resume equals the uninterrupted run.

A checkpoint inside a window of ``accumulative_counts`` lacks the pending gradients, so
checkpoints land where none is pending (``config.accumulation``); :func:`check_resume` refuses
a mid-window one (``resume_mid_window = True`` resumes), as :func:`record_window` recorded it.
"""

from __future__ import annotations

from mmengine.logging import print_log

WINDOW_KEY = "xtuner_rope.accumulation_window"  # message-hub key: {"counts": K, "open": bool}
RESUME_ANYWAY_KEY = "resume_mid_window"  # top-level config key: resume a mid-window checkpoint


class MidWindowResumeError(RuntimeError):
    """A resume from a checkpoint written inside an open accumulation window."""


def accumulation_state(optim_wrapper) -> tuple[int, bool]:
    """``(accumulative_counts, window open)`` after this iteration's ``update_params`` of
    ``optim_wrapper`` (MMEngine's ``OptimWrapper`` or ``DeepSpeedOptimWrapper``).
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

    Call in ``before_train``, after MMEngine resumed, before the first step.

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
    "record_window",
]
