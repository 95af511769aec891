"""What the family integrations read from the running trainer: the batch's boundaries (through
``models.channel``; ``ops.attention`` knows nothing of MMEngine) and the packed backend, logged
once per device and dtype.
"""

from __future__ import annotations

import torch
from mmengine.logging import print_log

from xtuner_rope.ops.attention import DocumentPlan, document_plan, packed_backend
from xtuner_rope.ops.host_copies import host_copy

from . import channel
from .channel import CUMULATIVE_KEY, MAX_SEQLEN_KEY, VARLEN_HUB

__all__ = [
    "CUMULATIVE_KEY",
    "MAX_SEQLEN_KEY",
    "VARLEN_HUB",
    "batch_document_plan",
    "choose_backend",
    "chosen_backends",
    "hub_cumulative_len",
    "rows_start_at_zero",
]

_LOGGED: set = set()
# Backends chosen since the last ``chosen_backends(reset=True)``: what ``check`` reports.
_CHOSEN: set = set()


def hub_cumulative_len() -> object:
    """The flat boundaries published for this rank (XTuner's ``MessageHub`` convention), or None."""
    return channel.read()[0]


# Whether the last position_ids tensor seen starts every row at 0 (left padding does not):
# every layer gets the same tensor, so the host read happens once per forward.
_STARTS: dict = {}


def rows_start_at_zero(position_ids: torch.Tensor) -> bool:
    """True if every row of ``position_ids`` ``[b, s]`` starts at 0 (a left-padded prompt does
    not): read on the ids' host copy (``ops.host_copies``), else one device read per tensor,
    cached for the next layer."""
    key = position_ids._version
    if _STARTS.get("source") is not position_ids or _STARTS.get("key") != key:
        host = host_copy(position_ids)
        values = position_ids if host is None else host
        starts = bool((values[:, 0] == 0).all())
        _STARTS.clear()
        _STARTS.update(source=position_ids, key=key, value=starts)
    return _STARTS["value"]


def batch_document_plan(
    position_ids: torch.Tensor | None, b: int, s: int, device: torch.device
) -> DocumentPlan | None:
    """``ops.attention.document_plan`` with this rank's published boundaries, if any."""
    return document_plan(
        position_ids,
        b,
        s,
        device,
        published=hub_cumulative_len(),
        source=f"MessageHub '{VARLEN_HUB}'",
    )


def choose_backend(q: torch.Tensor, eager: bool) -> str:
    """``ops.attention.packed_backend``, logged once per (backend, device type, dtype)."""
    backend = packed_backend(q, eager)
    _CHOSEN.add(backend)
    key = (backend, q.device.type, q.dtype)
    if key not in _LOGGED:
        _LOGGED.add(key)
        print_log(
            f"xtuner-rope: packed attention uses the '{backend}' backend "
            f"({q.device.type}, {q.dtype}).",
            logger="current",
        )
    return backend


def chosen_backends(reset: bool = False) -> list[str]:
    """The packed backends ``choose_backend`` returned since the last reset (sorted); ``reset``
    forgets them afterwards.
    """
    chosen = sorted(_CHOSEN)
    if reset:
        _CHOSEN.clear()
    return chosen
