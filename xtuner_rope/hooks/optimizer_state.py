"""The resume of a checkpoint without optimizer state, named in the log (``RandomStateHook``).

A checkpoint written with ``default_hooks.checkpoint.save_optimizer=False`` (XTuner 0.2.0's
stock InternVL configs; the start-up turns it on, ``config.optimizer_state``, unless the config
sets ``checkpoint_without_optimizer = True``) still resumes: MMEngine builds a fresh optimizer
without a word, so momentum and AdamW's moments restart from zero.
:func:`resume_without_optimizer_warning` names that resume in the log (``RandomStateHook``
calls it when the checkpoint is loaded). The start-up's finding that turns ``save_optimizer``
on is ``config.optimizer_state.save_optimizer_findings``.
"""

from __future__ import annotations

from xtuner_rope.config.optimizer_state import KEEP_OFF_KEY


def resume_without_optimizer_warning(runner, checkpoint: dict) -> str | None:
    """The warning for a resume from a checkpoint that holds no optimizer state, or None.

    Args:
        runner: MMEngine's runner, loading ``checkpoint`` (``after_load_checkpoint``).
        checkpoint: The loaded checkpoint dict.

    Returns:
        None for a plain load (``load_from`` without resume: the weights are all it needs),
        under DeepSpeed (its optimizer state lives in the folder's own files, not in this
        dict) or when the checkpoint holds ``optimizer``; else the warning.
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
