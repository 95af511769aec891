"""xtuner-rope: correct, crash-free RoPE and packed short-dialogue SFT for XTuner 0.x.

Turn it on in an XTuner config with ``model_resource = dict(fn=enable_xtuner_rope)`` (see
``xtuner_rope.config.startup``). This module is the public API: the names of ``__all__``.

Activation: ``import xtuner_rope`` (and importing any module of the face: ``config``, ``data``,
``hooks``, ``compat``, ``doctor``, ``cli`` ..., or reading a public name such as
``from xtuner_rope import enable_xtuner_rope``) applies the third-party patches of
``xtuner_rope.compat`` (each only where its gap exists) and registers the hooks in MMEngine's
``HOOKS``, the collate functions in ``FUNCTIONS`` and the metrics (``TokenLossMetric``,
``PreferenceMetric``) in ``METRICS``, so configs can name them by string as well as by
object. Importing the family-free math alone (``import xtuner_rope.ops.packing``) activates
nothing: no MMEngine, transformers or XTuner import, no patch. Nor does importing the
command line (``xtuner_rope.cli``): it answers ``--help`` and usage errors with the standard
library alone and activates the plugin when a subcommand runs.

What activation imports is what ``xtuner train`` 's start-up needs (``config/``, ``data/``,
``hooks/``, ``models/``, ``compat/``); the tools (``check/``, ``capture/``, ``zoo/``,
``doctor/``, ``outputs/``) load only when a command or a test uses them.
"""

from __future__ import annotations

import importlib
import sys

from . import deprecated

deprecated.install()

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
    "xtuner_rope.hooks.loss_norm",
    "xtuner_rope.hooks.chunked_loss",
    "xtuner_rope.hooks.accumulation",
    "xtuner_rope.config.optimizer_state",
    "xtuner_rope.config.warmup",
    "xtuner_rope.config.frameworks",
    "xtuner_rope.config.moss",
    "xtuner_rope.config.heldout.findings",
    "xtuner_rope.config.heldout.shortcut",
    "xtuner_rope.config.patch_needs",
)
FAMILY_FREE = ("xtuner_rope.ops",)  # subpackages whose import activates nothing
# Modules whose import activates nothing: the math, and the command line (each subcommand
# activates when it runs, so `xtuner-rope --help` imports no torch).
INERT = (*FAMILY_FREE, "xtuner_rope.cli")
_activated = False


def activate() -> None:
    """Apply the compat patches, register hooks/collate and the findings (idempotent)."""
    global _activated
    if _activated:
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


def __getattr__(name: str) -> object:
    """A public name read before activation (``from xtuner_rope import X``): activate first."""
    if name in PUBLIC_API:
        activate()
        return globals()[name]
    raise AttributeError(f"module 'xtuner_rope' has no attribute {name!r}")


def requested_module() -> str:
    """The module the running import statement asked for: ``xtuner_rope`` or a submodule.

    Python imports a package before its submodules, so ``import xtuner_rope.ops.packing`` runs
    this file first. The name asked for is the one of the outermost ``_find_and_load`` frame of
    importlib's bootstrap (the frames of the running import); outside an import, this package;
    under ``python -m xtuner_rope.X``, ``xtuner_rope.X``.
    """
    frame, asked = sys._getframe(1), __name__
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") and code.co_name == "_find_and_load":
            asked = frame.f_locals.get("name", asked)
        elif asked != __name__ and not code.co_filename.startswith("<frozen importlib"):
            break  # the statement that started this import
        frame = frame.f_back
    if asked == __name__ and sys.argv[:1] == ["-m"]:
        # `python -m xtuner_rope.cli`: runpy imports this package by its own name while it locates
        # the module (sys.argv[0] is "-m" meanwhile); the module asked for is on the command line.
        argv = getattr(sys, "orig_argv", [])
        found = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"]
        found += [arg[2:] for arg in argv if arg.startswith("-m") and len(arg) > 2]
        asked = found[0] if found else asked
    return asked


if not requested_module().startswith(INERT):
    activate()
