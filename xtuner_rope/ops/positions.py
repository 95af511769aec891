"""Position-id checks for RoPE: reject bad ids before any table lookup or kernel sees them.

Host ids (or device ids with a host copy, `ops.host_copies`) are read without a device sync;
other device ids once per tensor (shared by all layers), unless the caller knows their range on
the host (`known_range`).
"""

import weakref

import torch

from xtuner_rope.ops.host_copies import host_copy

# Min/max of the last position_ids checked; see `_min_max`.
_last_range = {}


def _min_max(position_ids):
    """(min, max) of integer `position_ids` as Python ints: one host sync, cached for the same
    tensor (identity, storage, version, shape), so only a model's first layer syncs.
    """
    if position_ids.numel() == 0:
        return 0, -1
    key = None
    if not position_ids.is_inference():  # inference tensors have no version counter
        key = (position_ids.data_ptr(), position_ids._version, tuple(position_ids.shape))
        ref = _last_range.get("ref")
        if ref is not None and ref() is position_ids and _last_range["key"] == key:
            return _last_range["value"]
    lo, hi = torch.stack(torch.aminmax(position_ids)).tolist()
    if key is not None:
        _last_range.update(ref=weakref.ref(position_ids), key=key, value=(lo, hi))
    return lo, hi


def _first(position_ids, mask):
    """Value, row and column of the first entry of `position_ids` `[b, s]` where `mask` holds."""
    row, col = mask.nonzero()[0].tolist()
    return position_ids[row, col].item(), row, col


def check_position_ids(
    position_ids, batch, seq_len, limit=None, limit_desc="", advice="", known_range=None
):
    """Check position ids before they index anything; return their (min, max) (0, -1 when empty).

    Args:
        position_ids (torch.Tensor): Integer positions `[b, s]`, b == 1 or `batch`.
        batch, seq_len (int): b and s of the activations.
        limit (int, optional): Positions must be below it; None means unbounded.
        limit_desc (str): Where `limit` comes from, for the error message.
        advice (str): What to do about a position beyond `limit`, for the error message.
        known_range (tuple[int, int], optional): (min, max) known on the host: returned within
            `limit` without reading the ids; beyond it, the ids are read to name the culprit.

    Raises:
        TypeError: position_ids is not an integer tensor.
        ValueError: Wrong shape, a negative position or a position >= limit.
    """
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
    dtype = position_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(
            f"position_ids must be an integer tensor (torch.long), got {dtype}; "
            "build them with torch.arange(...) or call .long() on them"
        )
    shape = tuple(position_ids.shape)
    if len(shape) != 2:
        raise ValueError(
            f"position_ids must be 2-D [b, s], got shape {shape}; "
            "use position_ids.view(1, -1) for a single sequence"
        )
    if shape[0] not in (1, batch) or shape[1] != seq_len:
        raise ValueError(
            f"position_ids has shape {shape} but the activations have batch "
            f"{batch} and sequence length {seq_len}: expected (1, {seq_len}) or "
            f"({batch}, {seq_len}), one position per token"
        )
    if known_range is not None and position_ids.device.type != "cpu":
        lo, hi = (int(v) for v in known_range)
        if lo >= 0 and (limit is None or hi < limit):
            return lo, hi
    host = host_copy(position_ids)  # the collated ids before their move: read without a sync
    if host is not None:
        position_ids = host
    if position_ids.device.type == "meta":
        raise ValueError(
            "position_ids is a meta tensor (no values to check or index with); "
            "materialize the model and its inputs (to_empty / real data) first"
        )
    lo, hi = _min_max(position_ids)
    if lo < 0:
        value, row, col = _first(position_ids, position_ids < 0)
        raise ValueError(
            f"position_ids must be non-negative, got {value} at row {row}, column "
            f"{col}; positions count tokens from 0 within each document"
        )
    if limit is not None and hi >= limit:
        # The largest position, not the first beyond the limit: rope_collate_fn keeps padding
        # segments shorter than the longest document, so this is the document at fault.
        value, row, col = _first(position_ids, position_ids == hi)
        raise ValueError(
            f"position_ids holds {value} at row {row}, column {col}, beyond the "
            f"supported range [0, {limit}) ({limit_desc}); {advice}"
        )
    return lo, hi
