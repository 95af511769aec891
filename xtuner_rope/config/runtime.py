"""Start-up findings of the run's machinery: the plugin's hooks in ``custom_hooks``, the optimizer
wrapper this machine can run (AMP needs a GPU), and ``sequence_parallel_size``
(:func:`~xtuner_rope.config.sequence_parallel.sequence_parallel_size_findings`).
"""

from __future__ import annotations

from mmengine.config import Config
from mmengine.config.lazy import LazyObject

from xtuner_rope.compat.devices import cpu_only
from xtuner_rope.compat.mmengine_config import config_dict

from .fields import lazy_get as _get
from .fields import type_name
from .findings import Finding
from .sequence_parallel import sequence_parallel_size_findings as _sequence_parallel_findings
from .startup import register_findings

# The plugin's hooks, in the order they are added to custom_hooks, and where they live.
PLUGIN_HOOKS = {
    "ValidatedRoPEHook": "xtuner_rope.hooks",
    "PackedBatchCheckHook": "xtuner_rope.hooks",
    "PackingMetricsHook": "xtuner_rope.hooks.monitor",
    "NonFiniteTripwireHook": "xtuner_rope.hooks.monitor",
    "TokenWeightedLossHook": "xtuner_rope.hooks.loss_norm",
    "RandomStateHook": "xtuner_rope.hooks.random_state",
}


@register_findings("hooks")
def _hook_findings(cfg: Config) -> list[Finding]:
    hooks = _get(config_dict(cfg), "custom_hooks")
    present = {type_name(_get(h, "type")) for h in hooks or []}
    missing = [name for name in PLUGIN_HOOKS if name not in present]
    if not missing:
        return []

    def add() -> None:
        added = [dict(type=LazyObject(PLUGIN_HOOKS[name], name)) for name in missing]
        if hooks is None:
            config_dict(cfg)["custom_hooks"] = added
        else:
            hooks[:0] = added

    return [
        Finding(
            "custom_hooks",
            f"{', '.join(missing)} missing",
            f"added {', '.join(f'dict(type={n})' for n in missing)}",
            add,
        )
    ]


@register_findings("runtime")
def _runtime_findings(cfg: Config) -> list[Finding]:
    """Settings the plugin cannot serve on this machine or at all."""
    findings = []
    optim = _get(config_dict(cfg), "optim_wrapper")
    if type_name(_get(optim, "type")) == "AmpOptimWrapper" and cpu_only():
        findings.append(
            Finding(
                "optim_wrapper.type",
                "AmpOptimWrapper needs a GPU (MMEngine refuses it on this CPU-only machine)",
                "use type=OptimWrapper (from mmengine.optim import OptimWrapper) "
                "and delete its loss_scale and dtype entries: full fp32 on CPU",
            )
        )
    return findings + _sequence_parallel_findings(cfg)
