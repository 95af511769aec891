"""The doctor's sequence-parallel figures: rows against ``sequence_parallel_size`` (padding, short
rows)."""

from __future__ import annotations

from collections.abc import Sequence

from xtuner_rope.batch.sequence_parallel import sequence_parallel_padding
from xtuner_rope.doctor.stats import Occurrences

__all__ = ["sequence_parallel_figures", "sequence_parallel_lines", "sequence_parallel_warnings"]


def sequence_parallel_figures(
    sp: object, row_lengths: Sequence[int], shapes: Sequence[tuple[int, int]]
) -> dict | None:
    """``size``, ``rows`` and ``batches`` figures of ``sequence_parallel_size`` ``sp`` on rows of
    ``[n]`` ``row_lengths`` and batches of ``(b, s)`` ``shapes``; None without sequence parallel."""
    if not isinstance(sp, int) or isinstance(sp, bool) or sp <= 1:
        return None
    shorter = Occurrences()
    pads = [sequence_parallel_padding(n, sp) for n in row_lengths]
    for i, n in enumerate(row_lengths):
        if n < sp:
            shorter.add(i)
    padding = sum(pads)
    tokens = sum(row_lengths)
    shards = [(s + sequence_parallel_padding(s, sp)) // sp for _, s in shapes]
    return {
        "size": sp,
        "rows": {
            "count": len(row_lengths),
            "shorter_than_size": vars(shorter),
            "needing_padding": sum(1 for p in pads if p),
            "padding_tokens": padding,
            "padding_share": padding / (tokens + padding) if tokens + padding else None,
        },
        "batches": {
            "count": len(shapes),
            "not_divisible": sum(1 for _, s in shapes if s % sp),
            "loss_padding_tokens": sum(b * sequence_parallel_padding(s, sp) for b, s in shapes),
            "shard_length": {"min": min(shards, default=None), "max": max(shards, default=None)},
        },
    }


def sequence_parallel_warnings(figures: dict | None) -> list[str]:
    """Rows shorter than the size: some ranks hold only padding (trains, at a cost)."""
    if not figures or not figures["rows"]["shorter_than_size"]["count"]:
        return []
    occ = figures["rows"]["shorter_than_size"]
    more = ", ..." if occ["count"] > len(occ["first_indices"]) else ""
    return [
        f"sequence_parallel_size={figures['size']}: {occ['count']} rows are shorter than "
        f"the size (first: {', '.join(map(str, occ['first_indices']))}{more}): some ranks "
        "get a shard of padding only (no loss, the compute spent all the same); pack the "
        "rows or lower sequence_parallel_size"
    ]


def sequence_parallel_lines(figures: dict | None) -> list[str]:
    """The doctor summary's lines (none without sequence parallel)."""
    if not figures:
        return []
    rows, batches = figures["rows"], figures["batches"]
    share = "n/a" if rows["padding_share"] is None else f"{100 * rows['padding_share']:.2f}%"
    shard = batches["shard_length"]
    return [
        f"seq-parallel size {figures['size']}: {rows['count']} rows, "
        f"{rows['shorter_than_size']['count']} shorter than the size, {rows['needing_padding']} "
        f"need a padding segment to a multiple of it (+{rows['padding_tokens']} tokens, "
        f"{share})",
        f"             collated batches: {batches['not_divisible']} of {batches['count']} still "
        f"not divisible (+{batches['loss_padding_tokens']} tokens padded by the loss); "
        f"per-rank shard {shard['min']}..{shard['max']} tokens",
    ]
