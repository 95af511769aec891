"""MMEngine hooks, the plugin's runtime. ``enable_xtuner_rope`` adds them; list them yourself
only to pass arguments."""

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
