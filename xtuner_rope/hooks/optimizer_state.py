"""The resume of a checkpoint without optimizer state, named in the log (``RandomStateHook``).

A checkpoint written with ``save_optimizer=False`` resumes with a fresh optimizer without a
word; :func:`resume_without_optimizer_warning` says so (``config.optimizer_state``).
"""

from __future__ import annotations

from xtuner_rope.config.optimizer_state import KEEP_OFF_KEY


def resume_without_optimizer_warning(runner, checkpoint: dict) -> str | None:
    """The warning for a resume from a checkpoint that holds no optimizer state, or None (a plain
    load, DeepSpeed's folder, a checkpoint with ``optimizer``); ``runner`` loads ``checkpoint``.
    """
    if not getattr(runner, "_resume", False) or "optimizer" in checkpoint:
        return None
    if type(getattr(runner, "strategy", None)).__name__.startswith("DeepSpeed"):
        return None
    iteration = (checkpoint.get("meta") or {}).get("iter")
    return (
        f"xtuner-rope: resuming from a checkpoint (iteration {iteration}) that holds no optimizer "
        "state (written with default_hooks.checkpoint.save_optimizer=False): the optimizer "
        "starts afresh (momentum and AdamW's moments at zero), so this run does not continue the "
        "interrupted one exactly. Resume from a checkpoint written with save_optimizer=True (the "
        f"start-up turns it on unless the config sets {KEEP_OFF_KEY} = True) to continue exactly"
    )


__all__ = ["KEEP_OFF_KEY", "resume_without_optimizer_warning"]
