"""The token columns of a built ``datasets.Dataset``, read as numpy blocks, never the whole
corpus."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from xtuner_rope.data.pack_plans import token_indices
from xtuner_rope.data.token_gather import TokenGather, drop_mapped_pages, table_and_order

TOKENS_PER_BLOCK = 1 << 21  # tokens per block read (16 MiB a column of int64)


def is_token_table(dataset: object, columns: tuple[str, ...] = ("input_ids", "labels")) -> bool:
    """True for a ``datasets.Dataset`` whose ``columns`` are lists of integers, none null."""
    names = getattr(dataset, "column_names", None)
    if names is None or not hasattr(dataset, "data") or not set(columns) <= set(names):
        return False
    table = dataset.data.table
    for name in columns:
        column = table.column(name)
        kind = column.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            return False
        if not pa.types.is_integer(kind.value_type) or column.null_count:
            return False
        if pc.sum(pc.list_value_length(column).is_null()).as_py():
            return False
    return True


def list_sizes(column) -> np.ndarray:
    """``[n]`` int64 row lengths of an Arrow list column."""
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def row_lengths(dataset, column: str = "input_ids") -> np.ndarray:
    """``[n]`` list lengths of ``column``, in the dataset's order (through its indices)."""
    table, order = table_and_order(dataset)
    lengths = list_sizes(table.column(column))
    return lengths if order is None else lengths[order]


def row_blocks(lengths: np.ndarray) -> Iterator[slice]:
    """Consecutive slices of whole rows of about ``TOKENS_PER_BLOCK`` tokens (``lengths``:
    ``[n]``)."""
    ends = np.cumsum(lengths)
    first = 0
    while first < len(lengths):
        budget = ends[first] - lengths[first] + TOKENS_PER_BLOCK
        last = max(int(np.searchsorted(ends, budget, side="right")), first + 1)
        yield slice(first, last)
        first = last


def list_column(dataset, column: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values [m], offsets [n + 1])`` of a small list column (``cumulative_len``), dataset
    order."""
    table, order = table_and_order(dataset)
    sizes = list_sizes(table.column(column))
    values = pc.list_flatten(table.column(column)).to_numpy(zero_copy_only=False)
    values = values.astype(np.int64)
    drop_mapped_pages([f["filename"] for f in dataset.cache_files])
    if order is not None:
        starts = np.cumsum(sizes) - sizes
        values = values[token_indices(starts[order], sizes[order])]
        sizes = sizes[order]
    return values, np.concatenate([[0], np.cumsum(sizes)])


def token_blocks(
    dataset, columns: tuple[str, ...] = ("input_ids", "labels"), table_order: bool = False
) -> Iterator[tuple[int, np.ndarray, dict[str, np.ndarray]]]:
    """Consecutive blocks of whole rows of ``dataset``'s equally long list ``columns``: ``(first_row,
    [r] lengths, {column: [t] tokens})``; ``table_order`` reads in stored order, not through a
    shuffle's indices."""
    table, order = table_and_order(dataset)
    lengths = list_sizes(table.column(columns[0]))
    if not len(lengths):
        return
    mapped = tuple(f["filename"] for f in dataset.cache_files)
    gather = TokenGather(table, columns, mapped)
    starts = np.cumsum(lengths) - lengths
    if order is not None and not table_order:
        lengths, starts = lengths[order], starts[order]
    for rows in row_blocks(lengths):
        yield rows.start, lengths[rows], gather.gather(starts[rows], lengths[rows])


def whole_matches(dialogue_keys: np.ndarray, segment_keys_: np.ndarray) -> np.ndarray:
    """``[k]`` bool: segment ``k`` is one whole dialogue, each dialogue matched once, in order;
    ``dialogue_keys`` ``[n, 3]``: the dialogues' ``data.dialogue_keys.segment_keys``,
    ``segment_keys_`` ``[k, 3]``: those of the packed documents, in stream order."""
    both = np.ascontiguousarray(np.concatenate([dialogue_keys, segment_keys_]))
    _, key = np.unique(both.view(np.dtype((np.void, 24))).ravel(), return_inverse=True)
    key = key.ravel()
    available = np.bincount(key[: len(dialogue_keys)], minlength=int(key.max(initial=-1)) + 1)
    segments = key[len(dialogue_keys) :]
    by_key = np.argsort(segments, kind="stable")
    ordered = segments[by_key]
    rank = np.empty(len(segments), dtype=np.int64)
    rank[by_key] = np.arange(len(segments)) - np.searchsorted(ordered, ordered, side="left")
    return rank < available[segments]
