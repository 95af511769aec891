""":func:`stats.scan_samples` on the Arrow columns of a ``datasets.Dataset``, block by block
(numpy)."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from xtuner_rope.data.collate import IGNORE_INDEX
from xtuner_rope.data.token_gather import drop_mapped_pages
from xtuner_rope.doctor.progress import Progress
from xtuner_rope.doctor.stats import SampleScan
from xtuner_rope.doctor.token_columns import is_token_table, list_sizes, row_blocks, row_lengths

BOUNDARIES = ("cumulative_len", "position_ids")  # document starts, in XTuner's packed rows


def is_scannable(dataset: object) -> bool:
    """True when :func:`scan_columns` can scan ``dataset`` (integer list columns, no nulls)."""
    if not is_token_table(dataset):
        return False
    extra = tuple(c for c in BOUNDARIES if c in dataset.column_names)
    return not extra or is_token_table(dataset, extra)


def _lists(table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values [m], sizes [r])`` of a list column of a block."""
    column = table.column(name)
    return pc.list_flatten(column).to_numpy(zero_copy_only=False), list_sizes(column)


def _starts(table, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows [s], columns [s], documents [r])``: every document start of a block's rows
    (``stats.document_starts``)."""
    r = len(n)
    rows = np.arange(r)
    if "cumulative_len" in table.column_names:
        values, sizes = _lists(table, "cumulative_len")
        row = np.repeat(rows, sizes)
        last = np.cumsum(sizes) - 1  # each row's last bound: its length, not a start
        keep = np.ones(len(values), dtype=bool)
        keep[last[sizes > 0]] = False
        keep &= values < n[row]
        row, col = row[keep], values[keep].astype(np.int64)
        found = np.bincount(row, minlength=r)
        lone = np.flatnonzero((found == 0) & (n > 0))  # no bound inside: [0]
        documents = np.where(n > 0, np.maximum(found, 1), 0)
    elif "position_ids" in table.column_names:
        values, sizes = _lists(table, "position_ids")
        row = np.repeat(rows, sizes)
        col = np.arange(len(values)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        zero = values == 0
        row, col = row[zero], col[zero]
        first_zero = np.zeros(r, dtype=bool)
        first_zero[row[col == 0]] = True
        lone = np.flatnonzero(~first_zero & (n > 0))  # {0} | the zeros
        documents = np.where(n > 0, np.bincount(row, minlength=r) + ~first_zero, 0)
    else:
        row, col = np.zeros(0, np.int64), np.zeros(0, np.int64)
        lone = np.flatnonzero(n > 0)
        documents = (n > 0).astype(np.int64)
    rows = np.concatenate([row, lone]).astype(np.int64)
    return rows, np.concatenate([col, np.zeros(len(lone), np.int64)]), documents


def _scan_block(table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(n, n_labels, supervised, documents)`` per row of a block."""
    n = list_sizes(table.column("input_ids"))
    labels, n_labels = _lists(table, "labels")
    label_starts = np.cumsum(n_labels) - n_labels
    used = labels != IGNORE_INDEX
    rows, cols, documents = _starts(table, n)
    inside = cols < n_labels[rows]
    used[label_starts[rows[inside]] + cols[inside]] = False  # never predicted from its document
    label_row = np.repeat(np.arange(len(n)), n_labels)
    supervised = np.bincount(label_row[used], minlength=len(n))
    return n, n_labels, supervised, documents


def scan_columns(
    dataset,
    *,
    collate_max_length: int | None,
    truncation_length: int | None,
    progress: Progress,
) -> SampleScan:
    """:func:`stats.scan_samples` (same arguments and results) of an :func:`is_scannable`
    ``datasets.Dataset``, read through a shuffle's or selection's indices."""
    scan = SampleScan()
    lengths = row_lengths(dataset)
    rows = dataset.with_format("arrow")
    files = [f["filename"] for f in dataset.cache_files]
    with progress.bar(int(lengths.sum()), f"samples, {len(dataset)} rows") as bar:
        for block in row_blocks(lengths):
            n, n_labels, supervised, documents = _scan_block(rows[block])
            drop_mapped_pages(files)
            scan.lengths += n.tolist()
            scan.supervised += supervised.tolist()
            scan.documents += int(documents.sum())
            checks = {
                "empty": n == 0,
                "unsupervised": (n > 0) & (supervised == 0),
                "over_long": n > collate_max_length if collate_max_length is not None else None,
                "truncated": n == truncation_length if truncation_length is not None else None,
                "length_mismatch": n != n_labels,
            }
            for kind, hit in checks.items():
                if hit is not None:
                    scan.issues[kind].add_all(np.flatnonzero(hit) + block.start)
            bar.update(int(n.sum()))
    return scan
