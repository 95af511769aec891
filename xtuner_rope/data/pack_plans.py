"""Where offline packing puts each token, from the dialogue lengths only: whole dialogues or
XTuner's cut.

Plans describe the rows as *pieces* of the tokenized stream in row order.
"""

from __future__ import annotations

import numpy as np

from xtuner_rope.ops.pack_planner import best_fit_decreasing

XTUNER_MAP_BATCH = 1000  # datasets.map's default batch_size: XTuner's Packer sees batches this big


def _check_max_length(max_length: object) -> None:
    integer = isinstance(max_length, (int, np.integer)) and not isinstance(max_length, bool)
    if not integer or max_length <= 0:
        raise ValueError(
            f"pack_dataset: max_length must be a positive integer, got "
            f"{max_length!r}; set max_length in PART 1 of the config."
        )


def cut_plan(
    lengths: np.ndarray, max_length: int, batch_size: int = XTUNER_MAP_BATCH
) -> np.ndarray:
    """``[r + 1]`` int64 row offsets where XTuner's Packer cuts a stream of ``[n]`` ``lengths``,
    ``batch_size`` dialogues a call, the final leftover kept.

    Raises:
        ValueError: ``max_length`` is not a positive integer.
    """
    _check_max_length(max_length)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    total = int(ends[-1]) if len(ends) else 0
    cuts, start = [np.zeros(1, dtype=np.int64)], 0
    for end in ends[batch_size - 1 :: batch_size].tolist() + [total]:
        rows = (end - start) // max_length
        if rows:
            cuts.append(start + max_length * np.arange(1, rows + 1, dtype=np.int64))
            start += rows * max_length
        elif end > start and end != total:  # a batch short of one row: XTuner emits it as is
            cuts.append(np.array([end], dtype=np.int64))
            start = end
    if total > start:
        cuts.append(np.array([total], dtype=np.int64))
    return np.concatenate(cuts)


def intern_repo_cut_plan(lengths: np.ndarray, packed_length: int) -> np.ndarray:
    """``[r + 1]`` int64 row offsets where XTuner's intern-repo ``PackedDataset`` cuts one file's
    stream of ``[n]`` ``lengths`` (last partial row dropped).

    Raises:
        ValueError: ``packed_length`` is not a positive integer.
    """
    _check_max_length(packed_length)
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return packed_length * np.arange(total // packed_length + 1, dtype=np.int64)


def cut_dialogues(lengths: np.ndarray, cuts: np.ndarray) -> int:
    """How many dialogues a row edge of ``cuts`` (stream offsets) falls strictly inside."""
    doc_offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])
    inner = cuts[(cuts > 0) & (cuts < doc_offsets[-1])]
    doc = np.searchsorted(doc_offsets, inner, side="right") - 1
    return int(len(np.unique(doc[doc_offsets[doc] != inner])))


def whole_plan(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each dialogue whole in one row, rows filled by best-fit decreasing, in stream order.

    ``lengths``: ``[n]`` token counts of the documents, in stream order, each >= 1.

    Returns:
        ``(starts, sizes, row_offsets)``: ``[p]`` stream offsets and lengths of the pieces in
        row order, and ``[r + 1]`` int64 offsets of each row's first piece into them.

    Raises:
        ValueError: ``max_length`` is not a positive integer, or a document is empty.
    """
    _check_max_length(max_length)
    lengths = np.asarray(lengths)
    if lengths.dtype.kind not in "iu":
        lengths = lengths.astype(np.int64)
    if len(lengths) and lengths.min() < 1:
        bad = int(np.argmin(lengths))
        raise ValueError(
            f"pack_dataset: dialogue {bad} of the tokenized dataset has no tokens (expected >= 1); "
            "filter empty dialogues out before packing (dataset.filter(lambda x: len(x['input_ids']))."
        )
    starts = np.cumsum(lengths, dtype=np.int64)
    starts -= lengths  # [n] document starts in the stream
    if len(lengths) and lengths.max() > max_length:  # split into max_length pieces first
        per_doc = -(-lengths // max_length)  # pieces per document: 1 unless longer than a row
        doc = np.repeat(np.arange(len(lengths)), per_doc)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
        starts = starts[doc] + k * max_length
        sizes = np.minimum(max_length, lengths[doc] - k * max_length)
        del doc, k
    else:
        sizes = lengths
    # Batch size 1: rows are not padded, so BFD's rows are kept as they are (no levelling).
    items, bfd_offsets = best_fit_decreasing(sizes, int(max_length))
    row_sizes = np.diff(bfd_offsets)
    by_first = np.argsort(items[bfd_offsets[:-1]], kind="stable")  # rows by their first piece
    row_offsets = np.zeros(len(row_sizes) + 1, dtype=np.int64)
    np.cumsum(row_sizes[by_first], out=row_offsets[1:])
    items = items[token_indices(bfd_offsets[:-1][by_first], row_sizes[by_first])]
    return starts[items], sizes[items], row_offsets


def token_indices(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``[sum(sizes)]`` the integers ``start .. start + size - 1`` of each piece, in order."""
    starts = np.asarray(starts, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    first = np.cumsum(sizes) - sizes
    return np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(starts - first, sizes)


def row_boundaries(doc_offsets: np.ndarray, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cumulative_len`` of rows ``cuts[0]..cuts[-1]`` (``[k + 1]`` row offsets into the stream
    whose document starts are ``[n + 1]`` ``doc_offsets``).

    Returns:
        ``(values, offsets)``: per row 0, its document starts and its length (as XTuner's
        Packer), ``offsets`` ``[k + 1]`` into ``values``.
    """
    lo = np.searchsorted(doc_offsets, cuts[:-1], side="right")
    hi = np.searchsorted(doc_offsets, cuts[1:], side="left")
    inner = hi - lo  # document starts strictly inside each row
    offsets = np.concatenate([[0], np.cumsum(inner + 2)])
    values = np.empty(offsets[-1], dtype=np.int64)
    values[offsets[:-1]] = 0
    values[offsets[1:] - 1] = cuts[1:] - cuts[:-1]
    if inner.sum():
        row = np.repeat(np.arange(len(inner)), inner)
        rank = np.arange(inner.sum()) - np.repeat(np.cumsum(inner) - inner, inner)
        values[offsets[row] + 1 + rank] = doc_offsets[lo[row] + rank] - cuts[row]
    return values, offsets


def position_ids(cum_values: np.ndarray, cum_offsets: np.ndarray) -> np.ndarray:
    """Flat ``[t]`` position ids restarting at 0 at every boundary of ``cumulative_len``."""
    starts = cum_values[np.setdiff1d(np.arange(len(cum_values)), cum_offsets[1:] - 1)]
    row_len = cum_values[cum_offsets[1:] - 1]
    row_base = np.concatenate([[0], np.cumsum(row_len)])
    seg_counts = np.diff(cum_offsets) - 1
    seg_starts = starts + np.repeat(row_base[:-1], seg_counts)
    seg_len = np.diff(np.concatenate([seg_starts, [row_base[-1]]]))
    return np.arange(row_base[-1]) - np.repeat(seg_starts, seg_len)


__all__ = [
    "XTUNER_MAP_BATCH",
    "cut_dialogues",
    "cut_plan",
    "intern_repo_cut_plan",
    "position_ids",
    "row_boundaries",
    "token_indices",
    "whole_plan",
]
