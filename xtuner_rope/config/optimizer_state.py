"""Start-up fix: checkpoints hold the optimizer state, so a resume continues the optimizer.

XTuner 0.2.0's stock InternVL configs set ``save_optimizer=False``: a resume builds a fresh
optimizer silently. :func:`save_optimizer_findings` turns it on (logged);
``checkpoint_without_optimizer = True`` keeps the small checkpoints (``hooks.optimizer_state``
warns what their resume does).
"""

from __future__ import annotations

from xtuner_rope.compat.mmengine_config import config_dict

from .fields import type_name
from .findings import Finding
from .startup import register_findings

KEEP_OFF_KEY = "checkpoint_without_optimizer"  # top-level config key: keep save_optimizer=False


@register_findings("checkpoint_saving")
def save_optimizer_findings(cfg) -> list[Finding]:
    """Start-up fix: ``default_hooks.checkpoint.save_optimizer`` on (none with
    ``checkpoint_without_optimizer = True``, or when the hook is not MMEngine's).
    """
    hooks = dict.get(config_dict(cfg), "default_hooks")
    hook = hooks.get("checkpoint") if isinstance(hooks, dict) else None
    if not isinstance(hook, dict) or hook.get("save_optimizer", True) is not False:
        return []
    if not type_name(hook.get("type", "CheckpointHook")).endswith("CheckpointHook"):
        return []
    if dict.get(config_dict(cfg), KEEP_OFF_KEY, False) is True:
        return []

    def save_it() -> None:
        hook["save_optimizer"] = True

    return [
        Finding(
            "default_hooks.checkpoint.save_optimizer",
            "False: the checkpoints hold the weights alone, and --resume of one silently "
            "restarts the optimizer (momentum, AdamW's moments) from zero, so the resumed run "
            "does not continue the interrupted one",
            "set to True: every checkpoint resumes exactly (each grows by the optimizer's "
            f"state); set {KEEP_OFF_KEY} = True at the top of the config to keep them small "
            "and accept a restarted optimizer on resume",
            save_it,
        )
    ]


__all__ = ["KEEP_OFF_KEY", "save_optimizer_findings"]
