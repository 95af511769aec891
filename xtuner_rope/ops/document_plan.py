"""Where the documents of a packed batch are: the plan every packed-attention backend reads.

Host boundaries (or device ones and position resets with a host copy, ``ops.host_copies``)
are planned without waiting on the device; else they are read once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xtuner_rope.ops.boundaries import check_flat_boundaries
from xtuner_rope.ops.host_copies import host_copy
from xtuner_rope.ops.packing import cumulative_from_position_ids, flat_cumulative

__all__ = [
    "MIN_BUCKET",
    "DocumentPlan",
    "document_plan",
    "host_to_device",
    "host_to_device_once",
    "plan_documents",
]

MIN_BUCKET = 16  # documents shorter than this share one bucket: fewer, larger kernel calls


def host_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``x`` on ``device`` in one non-blocking copy (on CUDA from pinned memory)."""
    if device.type == "cpu":
        return x
    if device.type == "cuda":
        x = x.pin_memory()  # the caching host allocator keeps it until the copy has run
    return x.to(device, non_blocking=True)


# The last host tensor copied by `host_to_device_once`, held strongly (no other tensor can take
# its identity while it is alive), with its version, the device and the copy.
_COPY_CACHE: dict = {}


def host_to_device_once(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host_to_device`` shared by every layer of a forward: one copy per host tensor (a tensor on
    ``device`` returned as is, one elsewhere moved).
    """
    device = torch.device(device)
    if x.device.type != "cpu":
        return x.to(device)
    if x.is_inference():  # no version counter to tell a changed tensor: copy each time
        return host_to_device(x, device)
    key = (x._version, str(device))
    if _COPY_CACHE.get("source") is not x or _COPY_CACHE.get("key") != key:
        _COPY_CACHE.clear()
        _COPY_CACHE.update(source=x, key=key, copy=host_to_device(x, device))
    return _COPY_CACHE["copy"]


@dataclass
class _Bucket:
    """Documents padded to a common length ``length`` for one attention call."""

    length: int
    gather: torch.Tensor  # [n, length] flat token index per (document, offset); pad repeats last
    keep: torch.Tensor  # [n_real] index of the real tokens in the flattened [n * length]


class DocumentPlan:
    """Where the documents of a batch are, in the flattened ``[b * s]`` token axis.

    Attributes:
        cu_seqlens: ``[n_docs + 1]`` int32 boundaries ``0 .. b*s`` on ``device``.
        max_seqlen: The longest document, a Python int (computed on the host).
        host_cu_seqlens: The same boundaries, int64, on the CPU.
        device: Where the index tensors live.
    """

    def __init__(self, host_cu: torch.Tensor, device: torch.device) -> None:
        self.host_cu_seqlens = host_cu
        self.device = torch.device(device)
        self.max_seqlen = int((host_cu[1:] - host_cu[:-1]).max())  # host tensor: no sync
        self.cu_seqlens = host_to_device(host_cu.to(torch.int32), self.device)
        self._buckets: tuple[list[_Bucket], torch.Tensor] | None = None

    @property
    def buckets_built(self) -> bool:
        """Whether the length buckets exist (only the SDPA/eager backend builds them)."""
        return self._buckets is not None

    @property
    def buckets(self) -> list[_Bucket]:
        """The documents grouped in length buckets, built on first use."""
        return self._bucketed()[0]

    @property
    def inverse(self) -> torch.Tensor:
        """``[b * s]`` row of each token in the bucket-ordered concatenation."""
        return self._bucketed()[1]

    def _bucketed(self) -> tuple[list[_Bucket], torch.Tensor]:
        if self._buckets is None:
            self._buckets = _build_buckets(self.host_cu_seqlens, self.device)
        return self._buckets


def _build_buckets(cu: torch.Tensor, device: torch.device) -> tuple[list[_Bucket], torch.Tensor]:
    """Length buckets of the documents of host boundaries ``cu`` ``[n_docs + 1]`` (int64)."""
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    # Bucket length: round up to a multiple of 1/8 of the power of two at or below the length
    # (at least MIN_BUCKET): padding stays under 12.5% (cost under 1.27x the exact sum of
    # squares) with 8 buckets per octave. Whole powers of two measured ~20% slower here.
    clamped = torch.clamp(lengths, min=MIN_BUCKET)
    step = torch.clamp(2 ** torch.floor(torch.log2(clamped.double())).long() // 8, min=MIN_BUCKET)
    bucket_len = (clamped + step - 1) // step * step
    buckets, order = [], []
    for length in torch.unique(bucket_len).tolist():  # host tensors: no device sync
        docs = torch.nonzero(bucket_len == length).flatten()
        offsets = torch.arange(length)
        last = (lengths[docs] - 1)[:, None]
        gather = starts[docs][:, None] + torch.minimum(offsets[None, :], last)  # [n, length]
        valid = offsets[None, :] <= last  # [n, length]
        # An index, not the bool mask: masking on the device would read the mask back.
        keep = torch.nonzero(valid.flatten()).flatten()  # [n_real]
        buckets.append(
            _Bucket(length, host_to_device(gather, device), host_to_device(keep, device))
        )
        order.append(gather[valid])
    order = torch.cat(order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return buckets, host_to_device(inverse, device)


def plan_documents(cu_seqlens: torch.Tensor, device: torch.device) -> DocumentPlan:
    """The plan of ``cu_seqlens``, ``[n_docs + 1]`` integer boundaries over the flat ``[b * s]``
    tokens (from 0, strictly increasing; on the CPU: no device sync), index tensors on ``device``
    (buckets built on first use).
    """
    return DocumentPlan(cu_seqlens.detach().to("cpu", torch.int64), device)


# The last plan, with a strong reference to the tensor it was computed from: while that tensor
# is alive no new tensor can share its identity, so a hit can never be a stale plan.
_PLAN_CACHE: dict = {}


def _cached_plan(source: torch.Tensor, extra: tuple, cu_fn, device: torch.device):
    """One plan per forward: every layer receives the same position-ids / boundaries tensor."""
    key = (source._version, extra, str(device))
    if _PLAN_CACHE.get("source") is not source or _PLAN_CACHE.get("key") != key:
        cu = cu_fn()
        plan = None if cu is None else plan_documents(cu, device)
        _PLAN_CACHE.clear()
        _PLAN_CACHE.update(source=source, key=key, plan=plan)
    return _PLAN_CACHE["plan"]


def _cu_from_position_ids(position_ids: torch.Tensor, b: int, s: int) -> torch.Tensor | None:
    """Flat boundaries from position resets (their host copy if any); None: one document a row."""
    host = host_copy(position_ids)
    rows = (position_ids.detach().to("cpu") if host is None else host).expand(b, s)  # [b, s]
    cus = [cumulative_from_position_ids(row) for row in rows]
    if all(cu.numel() == 2 for cu in cus):
        return None
    return flat_cumulative(cus, s)


def document_plan(
    position_ids: torch.Tensor | None,
    b: int,
    s: int,
    device: torch.device,
    published: object = None,
    source: str = "published boundaries",
) -> DocumentPlan | None:
    """The document layout of this forward: published boundaries first, then position resets.

    Published boundaries are checked (``check_flat_boundaries``) once per tensor; on the CPU they
    are planned without a device read, and ``position_ids`` are not read.

    Args:
        position_ids: ``[b, s]`` or ``[1, s]`` positions, or None.
        device: Where the plan's index tensors live.
        published: Flat ``[n_docs + 1]`` boundaries published for this batch, or None.
        source: Where ``published`` comes from, for error messages.

    Raises:
        TypeError: the published ``cumulative_len`` is not integer.
        ValueError: it does not describe this ``[b, s]`` batch.
    """
    cu = published
    if cu is not None:
        if not isinstance(cu, torch.Tensor):  # checked before the identity-keyed cache
            cu = check_flat_boundaries(cu, b, s, source)
        # Device boundaries (XTuner's VarlenAttnArgsToMessageHubHook moves them) are checked
        # on their host copy when one is known: nothing read back.
        host = host_copy(cu)
        values = cu if host is None else host
        return _cached_plan(
            cu, ("hub", b, s), lambda: check_flat_boundaries(values, b, s, source), device
        )
    if position_ids is None:
        return None
    return _cached_plan(
        position_ids, ("pos", b, s), lambda: _cu_from_position_ids(position_ids, b, s), device
    )
