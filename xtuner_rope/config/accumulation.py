"""Start-up fix: iteration checkpoints at accumulation-window boundaries.

A checkpoint inside an accumulation window lacks the pending gradients
(:mod:`xtuner_rope.hooks.accumulation`); the ``CheckpointHook`` interval (and ``save_begin``) is
raised to the next multiple of ``accumulative_counts`` (stock 500 with 16 becomes 512).
"""

from __future__ import annotations

import math

from xtuner_rope.compat.mmengine_config import config_dict

from .fields import type_name
from .findings import Finding
from .startup import register_findings

__all__ = ["accumulative_counts", "checkpoint_interval_findings"]


def accumulative_counts(cfg_dict: dict) -> int:
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

    Returns:
        One fix per ``default_hooks.checkpoint`` setting (``interval``, ``save_begin``) that is not
        a multiple of it; none for epoch checkpoints.
    """
    counts = accumulative_counts(config_dict(cfg))
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
