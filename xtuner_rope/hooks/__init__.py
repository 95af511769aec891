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
