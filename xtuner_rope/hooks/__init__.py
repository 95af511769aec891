"""MMEngine hooks, the plugin's runtime: document isolation and batch checks, monitoring, loss.

- ``isolation``: ``ValidatedRoPEHook`` (patches the model's family, publishes boundaries) and
  ``PackedBatchCheckHook`` (checks every packed batch before the forward);
- ``monitor``: ``PackingMetricsHook`` and ``NonFiniteTripwireHook``;
- ``loss_norm``: ``TokenWeightedLossHook`` (token-weighted loss across ranks and accumulation);
- ``chunked_loss``: the training loss in chunks of supervised tokens (``chunked_loss``), switched
  on by ``ValidatedRoPEHook.before_train``;
- ``random_state``: ``RandomStateHook`` (every process's random state with each checkpoint).

``enable_xtuner_rope`` adds them to ``custom_hooks``; list them yourself only to pass arguments.
"""

from __future__ import annotations

import importlib
import warnings

from .isolation import PackedBatchCheckHook, ValidatedRoPEHook
from .loss_norm import TokenWeightedLossHook
from .monitor import NonFiniteTripwireHook, PackingMetricsHook
from .random_state import RandomStateHook

__all__ = [
    "NonFiniteTripwireHook",
    "PackedBatchCheckHook",
    "PackingMetricsHook",
    "RandomStateHook",
    "TokenWeightedLossHook",
    "ValidatedRoPEHook",
]
# Names the old ``xtuner_rope/hooks.py`` module held besides the hooks -> where they live now.
MOVED_NAMES = {
    "patch_model": "xtuner_rope.models.dispatch",
    "isolates_documents": "xtuner_rope.models.dispatch",
    "refuse_unbounded_packing": "xtuner_rope.hooks.isolation",
    "VALIDATED_ROTARIES": "xtuner_rope.models.dispatch",
    "DATA_BATCH": "xtuner_rope.hooks.isolation",
}


def __getattr__(name: str) -> object:
    """``xtuner_rope.hooks.<old name>``: the name from its new module, with a warning."""
    if name not in MOVED_NAMES:
        raise AttributeError(f"module 'xtuner_rope.hooks' has no attribute {name!r}")
    new = MOVED_NAMES[name]
    warnings.warn(
        f"xtuner_rope.hooks.{name} is deprecated: import it from {new} "
        f"(`from {new} import {name}`).",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(new), name)
