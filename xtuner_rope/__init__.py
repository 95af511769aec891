"""xtuner-rope: correct, crash-free RoPE and packed short-dialogue SFT for XTuner 0.x.

Turn it on in an XTuner config with ``model_resource = dict(fn=enable_xtuner_rope)``; the public
API is ``__all__``. Importing a module activates nothing: :func:`activate` (the ``compat``
patches, MMEngine's registries, the start-up's findings) runs on reading a public name of this
module, on a subcommand of the command line, or when called. The tools (``check/``,
``capture/``, ``doctor/``, ``outputs/``) load only when used.
"""

from __future__ import annotations

import importlib
import threading

__version__ = "0.1.0"
# Public name -> the module that defines it (imported on first use, see `activate`).
PUBLIC_API = {
    "HeldOutCurvesHook": "xtuner_rope.evaluation.hook",
    "NonFiniteTripwireHook": "xtuner_rope.hooks.monitor",
    "PackedBatchCheckHook": "xtuner_rope.hooks.isolation",
    "PackingMetricsHook": "xtuner_rope.hooks.monitor",
    "PreferenceMetric": "xtuner_rope.evaluation.preference_metric",
    "RandomStateHook": "xtuner_rope.hooks.random_state",
    "TokenLossMetric": "xtuner_rope.evaluation.metric",
    "TokenWeightedLossHook": "xtuner_rope.hooks.loss_norm",
    "ValidatedRoPEHook": "xtuner_rope.hooks.isolation",
    "ValidatedRotaryEmbedding": "xtuner_rope.models.internlm2_rope",
    "apply_rotary_pos_emb": "xtuner_rope.ops.rope",
    "enable_xtuner_rope": "xtuner_rope.config.startup",
    "patch_internlm2_attention": "xtuner_rope.models.internlm2",
    "rope_collate_fn": "xtuner_rope.data.collate",
    "llava_collate_fn": "xtuner_rope.data.collate_llava",
    "internvl_collate_fn": "xtuner_rope.data.collate_internvl",
    # The tiny recipes' `model_resource` (configs/tiny_*.py): build the tiny models, then start.
    "tiny_checkpoint": "xtuner_rope.demo.resources",
    "tiny_llava": "xtuner_rope.demo.resources",
}
__all__ = sorted(PUBLIC_API)
# Where the plugin's findings functions live: importing them registers them with the start-up.
FINDINGS_MODULES = (
    "xtuner_rope.config.packing",
    "xtuner_rope.config.runtime",
    "xtuner_rope.config.families",
    "xtuner_rope.config.multimodal",
    "xtuner_rope.config.llava_tower",
    "xtuner_rope.config.checkpoint_findings",
    "xtuner_rope.config.internvl",
    "xtuner_rope.config.launch",
    "xtuner_rope.config.sequence_parallel",
    "xtuner_rope.config.rope_scaling",
    "xtuner_rope.config.preference",
    "xtuner_rope.config.loss",
    "xtuner_rope.config.accumulation",
    "xtuner_rope.config.optimizer_state",
    "xtuner_rope.config.warmup",
    "xtuner_rope.config.frameworks",
    "xtuner_rope.config.moss",
    "xtuner_rope.config.heldout.findings",
    "xtuner_rope.config.heldout.shortcut",
    "xtuner_rope.config.patch_needs",
)
_activated = False
_activation = threading.RLock()


def activate() -> None:
    """Turn the plugin on in this process (idempotent; importing a module never does).

    Applies the compat patches (each where its gap exists here), registers the findings
    modules with the start-up, the hooks in MMEngine's ``HOOKS``, the collate functions in
    ``FUNCTIONS`` and the metrics in ``METRICS`` (so a config's ``type='PackingMetricsHook'``
    resolves), and tells the start-up it may run (``config.startup.mark_active``).
    """
    with _activation:  # another thread reading a public name waits for the whole activation
        _activate()


def _activate() -> None:
    global _activated
    if _activated:  # done, or under way in this thread (activation imports the package)
        return
    _activated = True
    from mmengine.registry import FUNCTIONS, HOOKS, METRICS

    from . import compat

    compat.apply()
    from .data.preference_truncation import counted_preference_dataset
    from .data.truncation import counted_tokenize_step

    compat.apply_counting(counted_tokenize_step, counted_preference_dataset)
    for module in FINDINGS_MODULES:
        importlib.import_module(module)
    for name, module in PUBLIC_API.items():
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        if name.endswith("Hook"):
            HOOKS.register_module(module=value, force=True)
        elif name.endswith("_collate_fn"):
            FUNCTIONS.register_module(module=value, force=True)
        elif name.endswith("Metric"):
            METRICS.register_module(module=value, force=True)
    from .config.startup import mark_active

    mark_active()


def __getattr__(name: str) -> object:
    """A public name read before activation (``from xtuner_rope import X``): activate first."""
    if name in PUBLIC_API:
        activate()
        return globals()[name]
    raise AttributeError(f"module 'xtuner_rope' has no attribute {name!r}")
