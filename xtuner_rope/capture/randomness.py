"""Randomness off for ``xtuner-rope check``: both passes must compute the same function.

Packed and per-document passes draw different dropout masks (12-28% apart in LoRA gradients):
dropout, attention dropout and MoE router noise are set to 0, restored on exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

# Float attributes of layers that add randomness in training mode (transformers 4.48 names).
RANDOM_ATTRIBUTES = ("attention_dropout", "dropout", "jitter_noise", "router_jitter_noise")


@contextmanager
def randomness_off(model: nn.Module) -> Iterator[dict]:
    """Switch off dropout and router noise in ``model`` (every submodule) inside the context.

    Yields:
        What was off: ``{"dropout_modules": n, "dropout_p": [p > 0], "attributes": {name:
        [values > 0]}}``.
    """
    restore: list[tuple[object, str, float]] = []
    probabilities: set[float] = set()
    attributes: dict[str, set[float]] = {}
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                probabilities.add(float(module.p))
                restore.append((module, "p", module.p))
                module.p = 0.0
            continue
        for name in RANDOM_ATTRIBUTES:
            value = getattr(module, name, None)
            if isinstance(value, float) and not isinstance(value, bool) and value > 0:
                attributes.setdefault(name, set()).add(value)
                restore.append((module, name, value))
                setattr(module, name, 0.0)
    try:
        yield {
            "dropout_modules": sum(1 for m, n, _ in restore if n == "p"),
            "dropout_p": sorted(probabilities),
            "attributes": {k: sorted(v) for k, v in sorted(attributes.items())},
        }
    finally:
        for module, name, value in restore:
            setattr(module, name, value)


def describe(off: dict) -> str:
    """One line for the check's summary: what was switched off (or that there was none)."""
    parts = []
    if off["dropout_modules"]:
        ps = ", ".join(f"{p:g}" for p in off["dropout_p"])
        parts.append(f"{off['dropout_modules']} dropout modules (p {ps})")
    parts += [
        f"{name} {', '.join(f'{v:g}' for v in values)}"
        for name, values in off["attributes"].items()
    ]
    if not parts:
        return "none in this model (no dropout, no router noise)"
    return "off in both passes (packed and alone): " + "; ".join(parts)
