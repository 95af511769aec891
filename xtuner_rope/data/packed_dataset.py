"""XTuner's offline packing with every dialogue whole and nothing dropped.

:func:`lossless_process_hf_dataset` runs XTuner's pipeline with the pack step replaced by
:func:`pack_dataset`: each dialogue whole in one row (longer pretraining documents split), or
XTuner's cut with the leftover kept; rows are written next to the dataset's cache files.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from mmengine.logging import print_log

from .pack_plans import (
    cut_dialogues,
    cut_plan,
    position_ids,
    row_boundaries,
    whole_plan,
)
from .token_gather import TokenGather, drop_mapped_pages, list_lengths, table_and_order
from .truncation import counting_truncation, summed_figures, truncation_message, unit

ROWS_PER_WRITE = 64  # packed rows per Arrow write: bounds the working memory (~1 MiB a column)
PACKED_FORMAT = 2  # the packed files' layout and plan: change it when either changes
TOKENS_PER_GATHER = 1 << 21  # tokens per whole-dialogue gather and write (16 MiB a column)
_RECORDS: list[list] = []  # the open recorded_packs() blocks


@contextlib.contextmanager
def recorded_packs():
    """Record every :func:`pack_dataset` call made in this block (the doctor reads the very build).

    Yields:
        A list that gets ``(dialogues, packed)`` per call: the tokenized dialogues in packing order
        and the packed ``datasets.Dataset``.
    """
    record: list = []
    _RECORDS.append(record)
    try:
        yield record
    finally:
        _RECORDS.remove(record)


def _list_array(offsets: np.ndarray, values: pa.Array) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)


def packed_tables(
    table: pa.Table,
    max_length: int,
    use_varlen_attn: bool,
    whole: bool = True,
    mapped_files: tuple[str, ...] = (),
    order: np.ndarray | None = None,
):
    """Yield the packed rows of a tokenized table, a bounded number of rows per Arrow table.

    Args:
        table: Columns ``input_ids`` and ``labels`` (lists, one row per dialogue).
        mapped_files: The files ``table`` is memory-mapped from (pages released once read).
        order: ``[n]`` the table's rows in stream order (a shuffle), or None.
    """
    lengths = list_lengths(table.column("input_ids"), mapped_files)
    if whole:
        # What earlier steps read of the mapped table stays resident until released; the
        # plan reads only the lengths (``[n]`` arrays: the memory that grows with the corpus).
        drop_mapped_pages(list(mapped_files))
        # Rows gather their dialogues from anywhere in the mapped table, window by window: no
        # copy of the columns (``ChunkedArray.take`` would join every chunk first).
        tokens = TokenGather(table, ("input_ids", "labels"), mapped_files)
        starts, sizes, row_pieces = _whole_rows(lengths, order, max_length)
        del lengths
        ends = np.cumsum(sizes, dtype=np.int64)  # piece ends in the row-ordered stream
        cuts = np.concatenate([[0], ends[row_pieces[1:] - 1]])
        del ends
        step = max(1, TOKENS_PER_GATHER // int(max_length))
    else:  # the stream in order: each row one slice of it
        assert order is None, "XTuner's cut reads the table in order"
        flat = {k: pc.list_flatten(table.column(k)) for k in ("input_ids", "labels")}
        cuts = cut_plan(lengths, max_length)
        doc_offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        step = ROWS_PER_WRITE
    for first in range(0, len(cuts) - 1, step):
        rows = cuts[first : first + step + 1]
        offsets = rows - rows[0]
        if whole:
            pieces = slice(row_pieces[first], row_pieces[first + len(rows) - 1])
            gathered = tokens.gather(starts[pieces], sizes[pieces])
            columns = {k: _list_array(offsets, pa.array(v)) for k, v in gathered.items()}
            doc_offsets = rows[0] + np.concatenate([[0], np.cumsum(sizes[pieces])])
        else:
            columns = {
                k: _list_array(offsets, v.slice(rows[0], offsets[-1]).combine_chunks())
                for k, v in flat.items()
            }
        if use_varlen_attn:
            cum_values, cum_offsets = row_boundaries(doc_offsets, rows)
            columns["cumulative_len"] = _list_array(cum_offsets, pa.array(cum_values))
            columns["position_ids"] = _list_array(
                offsets, pa.array(position_ids(cum_values, cum_offsets))
            )
        yield pa.table(columns)


def _whole_rows(
    lengths: np.ndarray, order: np.ndarray | None, max_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``whole_plan``'s ``(starts, sizes, row_pieces)`` of the ``[n]`` table-ordered ``lengths``
    read in ``order``, ``starts`` into the table."""
    if order is None:
        return whole_plan(lengths, max_length)
    stream_lengths = lengths[order]
    starts, sizes, row_pieces = whole_plan(stream_lengths, max_length)
    stream_starts = np.cumsum(stream_lengths, dtype=np.int64)
    stream_starts -= stream_lengths
    del stream_lengths
    doc = np.searchsorted(stream_starts, starts, side="right") - 1  # [p] stream position
    starts -= stream_starts[doc]  # offset inside the dialogue
    del stream_starts
    table_starts = np.cumsum(lengths, dtype=np.int64)
    table_starts -= lengths
    starts += table_starts[order[doc]]
    return starts, sizes, row_pieces


def _output_path(dataset, *plan_args) -> Path:
    """Where the packed rows go: beside the dataset's cache files, named by its fingerprint and
    args."""
    from datasets.fingerprint import get_temporary_cache_files_directory

    files = dataset.cache_files
    folder = (
        Path(files[0]["filename"]).parent if files else Path(get_temporary_cache_files_directory())
    )
    # ``_fingerprint`` is how datasets 2.x-5.x name a dataset's state (no public accessor).
    fingerprint = getattr(dataset, "_fingerprint", None) or uuid.uuid4().hex
    key = repr((PACKED_FORMAT, fingerprint, len(dataset), *plan_args)).encode()
    return folder / f"xtuner-rope-packed-{hashlib.sha256(key).hexdigest()[:32]}.arrow"


def pack_dataset(
    dataset,
    max_length,
    use_varlen_attn,
    shuffle_before_pack,
    map_num_proc,
    whole=True,
    truncation=None,
):
    """XTuner's ``pack_dataset`` (same arguments), every dialogue whole and every token kept.

    Args:
        whole: Each dialogue whole in one row (the default); False: XTuner's cut.
        truncation: The tokenize step's cut figures (``data.truncation``), or None.

    Raises:
        ValueError: a column XTuner packs is missing, or a dialogue has no tokens.
    """
    from datasets import Dataset

    missing = {"input_ids", "labels"} - set(dataset.column_names)
    if missing:
        raise ValueError(
            f"pack_dataset: the tokenized dataset has no column(s) {sorted(missing)} "
            f"(columns: {dataset.column_names}); pack_to_max_length needs "
            "tokenized dialogues (input_ids and labels)."
        )
    # Pages of the tokenized files that earlier steps read (tokenize, filter, the ``length``
    # map) stay resident in this process until released: none is needed to plan.
    drop_mapped_pages([f["filename"] for f in dataset.cache_files])
    if shuffle_before_pack:
        dataset = dataset.shuffle()  # numpy's global generator, drawn from as XTuner draws
        if not whole:  # XTuner's cut reads the shuffled stream in order: written out, as XTuner
            dataset = dataset.flatten_indices(num_proc=map_num_proc)
    # Whole rows read the table through a shuffle's indices; XTuner's cut reads the flattened
    # table (zero-copy slices of the cache files).
    table, order = table_and_order(dataset) if whole else (dataset.with_format("arrow")[:], None)
    path = _output_path(dataset, int(max_length), bool(use_varlen_attn), bool(whole))
    if path.exists():  # packed before from the same dialogues and arguments
        packed = Dataset.from_file(str(path))
        tokens, labels = _token_counts(packed.with_format("arrow")[:])
        drop_mapped_pages([str(path)])
    else:
        tokens, labels = _write_rows(
            dataset, table, order, path, max_length, use_varlen_attn, whole
        )
        packed = Dataset.from_file(str(path))
    lengths = list_lengths(
        table.column("input_ids"), tuple(f["filename"] for f in dataset.cache_files)
    )
    lengths = lengths if order is None else lengths[order]  # in stream order
    for record in _RECORDS:
        record.append((dataset, packed))
    figures = summed_figures(truncation or [])
    print_log(
        _summary(lengths, (tokens, labels), len(packed), max_length, whole, figures),
        logger="current",
        level=logging.WARNING if truncation_message(figures) else logging.INFO,
    )
    return packed


def _write_rows(dataset, table, order, path: Path, max_length, use_varlen_attn, whole) -> tuple:
    """Write the packed rows to ``path`` (whole or not at all); their tokens and labels."""
    from datasets.arrow_writer import ArrowWriter

    mapped = tuple(f["filename"] for f in dataset.cache_files)
    partial = path.with_name(f"{path.stem}.{uuid.uuid4().hex}.partial")
    tokens = labels = 0
    with ArrowWriter(path=str(partial)) as writer:
        # The rows hold every token: count them as they are written (the tokenized columns,
        # read once by the gather, are not read again).
        for part in packed_tables(table, max_length, use_varlen_attn, whole, mapped, order):
            writer.write_table(part)
            part_tokens, part_labels = _token_counts(part)
            tokens, labels = tokens + part_tokens, labels + part_labels
        writer.finalize()
    os.replace(partial, path)  # a start killed mid-write leaves no rows to reuse
    return tokens, labels


def _summary(
    lengths: np.ndarray,
    counts: tuple[int, int],
    rows: int,
    max_length: int,
    whole: bool,
    truncation: dict | None,
) -> str:
    """The start-up's line on what tokenizing and packing did, with XTuner's cut to compare."""
    tokens, labels = counts
    cuts = cut_plan(lengths, max_length)
    fill = tokens / max(rows * max_length, 1)
    what = unit(truncation)
    cut_message = truncation_message(truncation)
    head = (
        f"xtuner-rope: packed {len(lengths)} {what} ({tokens} tokens, {labels} supervised "
        f"labels) into {rows} rows of max_length={max_length} (fill {fill:.1%}), "
        + ("nothing dropped" if cut_message is None else "nothing dropped by packing")
    )
    tail = "" if cut_message is None else f". {cut_message}"
    xtuner_cut = cut_dialogues(lengths, cuts)
    if not whole:
        return (
            f'{head}; XTuner\'s cut (offline_packing = "cut"): '
            f"{xtuner_cut} {what} cut at row edges, trained as pieces{tail}."
        )
    split = int((lengths > max_length).sum())
    epoch = (
        f"an epoch is {rows} rows instead of {len(cuts) - 1} (iterations per epoch change with it)"
        if rows != len(cuts) - 1
        else "an epoch has as many rows"
    )
    return (
        f"{head}; every {unit(truncation, False)} whole in one row"
        + (
            f" ({split} documents longer than a row split into max_length pieces, every "
            "token trained once)"
            if split
            else ""
        )
        + f". XTuner's cut would make {len(cuts) - 1} rows and cut {xtuner_cut} {what}: "
        f"{epoch}{tail}."
    )


def _token_counts(table: pa.Table) -> tuple[int, int]:
    """Tokens and labels other than -100 (XTuner's IGNORE_INDEX) of a table of token lists."""
    labels = pc.list_flatten(table.column("labels"))
    return len(pc.list_flatten(table.column("input_ids"))), int(
        pc.sum(pc.not_equal(labels, -100)).as_py() or 0
    )


def lossless_process_hf_dataset(dataset, whole_dialogues: bool = True, **kwargs):
    """``xtuner.dataset.process_hf_dataset`` (same arguments), each dialogue packed whole.

    Args:
        whole_dialogues: False keeps XTuner's cut of the stream (``offline_packing = "cut"``),
            leftover kept.

    Raises:
        TypeError: ``whole_dialogues`` is not a bool.
    """
    from xtuner.dataset.huggingface import process_hf_dataset

    from xtuner_rope.compat.xtuner_packing import xtuner_pack_step

    if not isinstance(whole_dialogues, bool):
        raise TypeError(
            f"lossless_process_hf_dataset: whole_dialogues: expected True or False, got "
            f'{whole_dialogues!r}; set offline_packing = "whole" or "cut" at the top '
            "level of the config instead."
        )
    with counting_truncation(split_documents=whole_dialogues) as truncation:
        pack = functools.partial(pack_dataset, whole=whole_dialogues, truncation=truncation)
        with xtuner_pack_step(pack):
            return process_hf_dataset(dataset, **kwargs)


__all__ = ["lossless_process_hf_dataset", "pack_dataset", "recorded_packs"]
