"""Pure functions for packed sequences: lengths, boundaries, position ids, pack plans.

A *row* (``s`` tokens) is cut into *segments* (documents, then a padding segment);
``cumulative_len`` (``cu``) lists a row's boundaries ``[0, l_0, l_0 + l_1, ..., s]`` as
flash-attn's ``cu_seqlens`` and XTuner's ``cumulative_len``; position ids restart at 0 at every
boundary, so each document sees the RoPE angles it sees alone. torch and numpy only.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from .pack_planner import best_fit_decreasing

__all__ = [
    "cumulative_from_lengths",
    "lengths_from_cumulative",
    "position_ids_from_cumulative",
    "cumulative_from_position_ids",
    "segment_starts_from_cumulative",
    "position_ids_from_starts",
    "flat_cumulative",
    "lay_out_rows",
    "plan_packs",
    "padded_length",
]

IntSeq = Sequence[int] | torch.Tensor


def cumulative_from_lengths(lengths: IntSeq) -> torch.Tensor:
    """Turn ``[n]`` segment lengths (each >= 1) into ``[n + 1]`` int32 boundaries ``[0, l_0, ...,
    sum(lengths)]`` (int32: flash-attn's varlen kernels require it).

    Raises:
        ValueError: a length is < 1 (an empty segment has no boundary of its own).
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
    if lengths.numel() and int(lengths.min()) < 1:
        bad = int((lengths < 1).nonzero()[0])
        raise ValueError(
            f"lengths[{bad}]: expected a segment length >= 1, got {int(lengths[bad])}; "
            "drop empty documents before packing."
        )
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return cu


def lengths_from_cumulative(cu: IntSeq) -> torch.Tensor:
    """Inverse of :func:`cumulative_from_lengths`: ``[n + 1]`` boundaries -> ``[n]`` lengths."""
    cu = torch.as_tensor(cu, dtype=torch.long).reshape(-1)
    return cu[1:] - cu[:-1]


def position_ids_from_cumulative(cu: IntSeq) -> torch.Tensor:
    """``[s]`` long position ids of one row (``s = cu[-1]``): 0, 1, 2, ... restarting at every
    boundary of its ``[n + 1]`` boundaries ``cu`` (``cu[0] == 0``, strictly increasing).
    """
    cu = torch.as_tensor(cu, dtype=torch.long).reshape(-1)
    lengths = cu[1:] - cu[:-1]
    s = int(cu[-1])
    # Each token's position is its column minus the start column of its segment.
    return torch.arange(s, dtype=torch.long) - torch.repeat_interleave(cu[:-1], lengths)


def cumulative_from_position_ids(position_ids: IntSeq) -> torch.Tensor:
    """``[n + 1]`` int32 boundaries (ending at ``s``) of one row from its ``[s]`` position ids: a
    segment starts at column 0 and wherever the position is 0 (XTuner's Packer restarts there).
    """
    position_ids = torch.as_tensor(position_ids).reshape(-1)
    s = position_ids.numel()
    starts = position_ids == 0
    if s:
        starts[0] = True
    cols = starts.nonzero().reshape(-1).to(torch.int32)
    return torch.cat([cols, torch.tensor([s], dtype=torch.int32)])


def flat_cumulative(cus: Sequence[torch.Tensor], s: int) -> torch.Tensor:
    """Per-row boundaries ``cus`` (``b`` tensors ``[0, ..., s]``) of a ``[b, s]`` batch as one
    ``[n_docs + 1]`` int32 tensor ``0 .. b * s`` over the flattened tokens (``cu_seqlens``).
    """
    starts = [
        torch.as_tensor(cu).reshape(-1)[:-1].to(torch.int32) + r * s for r, cu in enumerate(cus)
    ]
    return torch.cat(starts + [torch.tensor([len(cus) * s], dtype=torch.int32)])


def segment_starts_from_cumulative(cus: Sequence[torch.Tensor], s: int) -> torch.Tensor:
    """``[b, s]`` bool, True at each segment's first column, from ``b`` boundary tensors ``cus``
    (each ``0 .. s``, strictly increasing).
    """
    b = len(cus)
    counts = torch.tensor([cu.numel() for cu in cus], dtype=torch.long)
    flat = torch.cat([torch.as_tensor(cu).reshape(-1) for cu in cus]).long()
    rows = torch.repeat_interleave(torch.arange(b), counts)
    # One spare column takes the final boundary (== s) so no mask is needed.
    starts = torch.zeros(b, s + 1, dtype=torch.bool)
    starts[rows, flat] = True
    return starts[:, :s]


def position_ids_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` long position ids restarting at 0 at every start of the ``[b, s]`` bool mask
    ``starts`` (column 0 is a start whatever it holds).
    """
    b, s = starts.shape
    cols = torch.arange(s, dtype=torch.long).expand(b, s)
    start_cols = torch.where(starts, cols, torch.zeros_like(cols))
    # The latest start at or before each column; column 0 counts as a start via the 0 fill.
    last_start = start_cols.cummax(dim=1).values
    return cols - last_start


def lay_out_rows(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    plan: Sequence[Sequence[int]],
    pad_index: int,
    ignore_index: int = -100,
) -> dict:
    """Lay whole samples into the rows of a pack plan, each sample its own segment.

    Args:
        samples: ``(input_ids, labels)`` per sample, both 1-D of one length ``n_i >= 1``.
        plan: The samples of each row, in order (``plan_packs``, or ``[[i]]`` per sample).
        ignore_index: Label of the padding and of each sample's first token.

    Returns:
        ``input_ids`` / ``labels`` / ``attention_mask`` / ``position_ids`` ``[b, s]``,
        ``cumulative_len`` (``b`` int32 ``0 .. s``, padding its own segment), ``max_seqlen``.
    """
    s = max(sum(samples[i][0].numel() for i in row) for row in plan)
    b = len(plan)
    input_ids = torch.full((b, s), int(pad_index), dtype=torch.long)
    labels = torch.full((b, s), ignore_index, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.bool)
    cumulative_len = []
    for r, row in enumerate(plan):
        col, sizes = 0, []
        for i in row:
            ids, lab = samples[i]
            n = ids.numel()
            input_ids[r, col : col + n], labels[r, col : col + n] = ids, lab
            labels[r, col] = ignore_index
            col += n
            sizes.append(n)
        mask[r, :col] = True
        cumulative_len.append(cumulative_from_lengths(sizes + ([s - col] if col < s else [])))
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": mask,
        "position_ids": position_ids_from_starts(segment_starts_from_cumulative(cumulative_len, s)),
        "cumulative_len": cumulative_len,
        "max_seqlen": max(int((cu[1:] - cu[:-1]).max()) for cu in cumulative_len),
    }


def _longest_row(lengths: Sequence[int], rows: list[list[int]]) -> int:
    return max(sum(lengths[i] for i in row) for row in rows)


def _levelled(lengths: Sequence[int], order: list[int], n_rows: int) -> list[list[int]]:
    """Longest first, each item into the currently shortest of ``n_rows`` rows."""
    heap = [(0, r) for r in range(n_rows)]
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    for i in order:
        load, r = heapq.heappop(heap)
        rows[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return rows


def plan_packs(lengths: Sequence[int], max_length: int, level: bool = True) -> list[list[int]]:
    """Group whole items into as few rows of at most ``max_length`` tokens as best-fit decreasing
    finds: the one row planner of every packing (collate time and offline).

    With ``level`` the items are then spread over that many rows, longest first into the shortest
    (every row of a batch is padded to the longest), unless that overflows or lengthens the longest
    row. Deterministic (ties by index); rows list their items in original order; ``O(n log n)``.

    Args:
        lengths: ``[n]`` item lengths, each in ``[1, max_length]`` (a list or a 1-D array).
        max_length: capacity of a row in tokens.
        level: Spread the items as above; False keeps the BFD rows (offline packing).

    Returns:
        Rows as lists of item indices, ordered by the row's first-placed (longest) item.

    Raises:
        ValueError: ``max_length`` < 1, or an item is empty or longer than ``max_length``.
    """
    if max_length < 1:
        raise ValueError(f"max_length: expected >= 1, got {max_length}.")
    lengths = [int(n) for n in lengths]
    if lengths and not 1 <= min(lengths) <= max(lengths) <= max_length:
        i = next(i for i, n in enumerate(lengths) if not 1 <= n <= max_length)
        raise ValueError(
            f"lengths[{i}]: expected 1..max_length={max_length} tokens, got {lengths[i]}; "
            "drop empty items and truncate long ones before packing."
        )
    items, row_offsets = best_fit_decreasing(np.asarray(lengths, dtype=np.int64), max_length)
    items = items.tolist()
    rows = [items[a:b] for a, b in itertools.pairwise(row_offsets.tolist())]
    if level and len(rows) > 1:
        # Longest first, ties by index (a stable sort of the negated lengths).
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        levelled = _levelled(lengths, order, len(rows))
        # Every BFD row fits, so no longer than BFD's longest row also means it fits.
        if _longest_row(lengths, levelled) <= _longest_row(lengths, rows):
            rows = [sorted(row) for row in levelled]
    return rows


def padded_length(
    longest: int, *, pad_to_multiple_of: int | None = None, min_length: int | None = None
) -> int:
    """Row length ``s`` for a batch whose longest row holds ``longest`` tokens: rounded up to a
    multiple of ``pad_to_multiple_of`` and to at least ``min_length`` (a multiple too, when both
    are given)."""
    s = max(longest, min_length or 0)
    if pad_to_multiple_of:
        s = -(-s // pad_to_multiple_of) * pad_to_multiple_of
    return s
