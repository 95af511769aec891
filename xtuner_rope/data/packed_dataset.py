"""XTuner's offline packing without its losses: every token and label of the dataset is kept.

xtuner 0.2.0's ``process_hf_dataset(pack_to_max_length=True)`` packs with its ``Packer`` through
``datasets.map(batched=True, num_proc=map_num_proc)``: the Packer carries each batch's
leftover into the next batch, but every map worker packs its own shard and the leftover below
``max_length`` at the end of each shard is dropped (up to ``map_num_proc`` times
``max_length`` tokens; 38% of the tokens of 2,400 short alpaca dialogues at the default 32).

:func:`lossless_process_hf_dataset` takes the same arguments and runs XTuner's own pipeline
(loading, map and template functions, tokenization, filtering, shuffle, ``length``), with
the pack step replaced by :func:`pack_dataset`: the packs XTuner's Packer makes over the
whole dataset in one stream (what ``map_num_proc=1`` gives, batches of 1000 included), and the
final leftover kept as a short last row. The cut is planned with numpy from the dialogue
lengths and the rows are written as Arrow slices of the tokenized columns, so it scales like
XTuner's (no Python list per token) and writes its rows to a cache file next to the
dataset's, as ``datasets.map`` does. Dialogues are still cut at row edges, as in XTuner (the
cut-off part restarts at position 0).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from mmengine.logging import print_log

XTUNER_MAP_BATCH = 1000  # datasets.map's default batch_size: XTuner's Packer sees batches this big
ROWS_PER_WRITE = 64  # packed rows per Arrow write: bounds the working memory (~1 MiB a column)


def pack_plan(
    lengths: np.ndarray, max_length: int, batch_size: int = XTUNER_MAP_BATCH
) -> np.ndarray:
    """Where XTuner's Packer cuts one stream of dialogues, the final leftover kept.

    The Packer concatenates each batch onto the previous leftover and cuts whole
    ``max_length`` rows; a batch that does not fill one row comes out as one short row. The
    leftover after the last batch is a last, short row here (XTuner drops it).

    Args:
        lengths: ``[n]`` token counts of the dialogues, in stream order.
        max_length: Tokens per packed row.
        batch_size: Dialogues per Packer call.

    Returns:
        ``[r + 1]`` int64 row offsets into the concatenated stream (0 first, the total last).

    Raises:
        ValueError: ``max_length`` is not a positive integer.
    """
    if not isinstance(max_length, (int, np.integer)) or max_length <= 0:
        raise ValueError(
            f"pack_dataset: max_length must be a positive integer, got "
            f"{max_length!r}; set max_length in PART 1 of the config."
        )
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


def _row_boundaries(doc_offsets: np.ndarray, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cumulative_len`` of rows ``cuts[0]..cuts[-1]``: flat values and their list offsets.

    Args:
        doc_offsets: ``[n + 1]`` dialogue starts in the stream (the total last).
        cuts: ``[k + 1]`` row offsets of consecutive rows.

    Returns:
        ``(values, offsets)``: per row, 0, the dialogue starts inside it and its length, as
        XTuner's Packer writes them; ``offsets`` is ``[k + 1]`` into ``values``.
    """
    lo = np.searchsorted(doc_offsets, cuts[:-1], side="right")
    hi = np.searchsorted(doc_offsets, cuts[1:], side="left")
    inner = hi - lo  # dialogue starts strictly inside each row
    offsets = np.concatenate([[0], np.cumsum(inner + 2)])
    values = np.empty(offsets[-1], dtype=np.int64)
    values[offsets[:-1]] = 0
    values[offsets[1:] - 1] = cuts[1:] - cuts[:-1]
    if inner.sum():
        row = np.repeat(np.arange(len(inner)), inner)
        rank = np.arange(inner.sum()) - np.repeat(np.cumsum(inner) - inner, inner)
        values[offsets[row] + 1 + rank] = doc_offsets[lo[row] + rank] - cuts[row]
    return values, offsets


def _position_ids(cum_values: np.ndarray, cum_offsets: np.ndarray) -> np.ndarray:
    """Flat ``[t]`` position ids restarting at 0 at every boundary of ``cumulative_len``."""
    starts = cum_values[np.setdiff1d(np.arange(len(cum_values)), cum_offsets[1:] - 1)]
    row_len = cum_values[cum_offsets[1:] - 1]
    row_base = np.concatenate([[0], np.cumsum(row_len)])
    seg_counts = np.diff(cum_offsets) - 1
    seg_starts = starts + np.repeat(row_base[:-1], seg_counts)
    seg_len = np.diff(np.concatenate([seg_starts, [row_base[-1]]]))
    return np.arange(row_base[-1]) - np.repeat(seg_starts, seg_len)


def _list_array(offsets: np.ndarray, values: pa.Array) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)


def packed_tables(table: pa.Table, max_length: int, use_varlen_attn: bool, plan=pack_plan):
    """Yield the packed rows of a tokenized table, ``ROWS_PER_WRITE`` rows per Arrow table.

    Args:
        table: Columns ``input_ids`` and ``labels`` (lists, one row per dialogue).
        max_length: Tokens per packed row.
        use_varlen_attn: Also write ``cumulative_len`` and ``position_ids`` (as XTuner).
        plan: ``(lengths [n], max_length) -> [r + 1]`` row offsets: :func:`pack_plan`
            (XTuner's cuts) or ``data.heldout_dataset.whole_dialogue_plan`` (no dialogue cut).

    Yields:
        Tables with XTuner's packed columns.
    """
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    doc_offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    cuts = plan(lengths, max_length)
    flat = {k: pc.list_flatten(table.column(k)) for k in ("input_ids", "labels")}
    for first in range(0, len(cuts) - 1, ROWS_PER_WRITE):
        rows = cuts[first : first + ROWS_PER_WRITE + 1]
        offsets = rows - rows[0]
        columns = {
            k: _list_array(offsets, v.slice(rows[0], offsets[-1]).combine_chunks())
            for k, v in flat.items()
        }
        if use_varlen_attn:
            cum_values, cum_offsets = _row_boundaries(doc_offsets, rows)
            columns["cumulative_len"] = _list_array(cum_offsets, pa.array(cum_values))
            columns["position_ids"] = _list_array(
                offsets, pa.array(_position_ids(cum_values, cum_offsets))
            )
        yield pa.table(columns)


def _output_path(dataset) -> Path:
    """Where the packed rows go: beside the dataset's cache files, as ``datasets.map`` does."""
    from datasets.fingerprint import get_temporary_cache_files_directory

    files = dataset.cache_files
    folder = (
        Path(files[0]["filename"]).parent if files else Path(get_temporary_cache_files_directory())
    )
    return folder / f"xtuner-rope-packed-{uuid.uuid4().hex}.arrow"


def pack_dataset(
    dataset, max_length, use_varlen_attn, shuffle_before_pack, map_num_proc, plan=pack_plan
):
    """XTuner's ``pack_dataset`` (same arguments), keeping every token: see the module docstring.

    Args:
        dataset: Tokenized ``datasets.Dataset`` with ``input_ids`` and ``labels``.
        max_length: Tokens per packed row.
        use_varlen_attn: Write ``cumulative_len`` and ``position_ids`` (as XTuner).
        shuffle_before_pack: Shuffle the dialogues first (as XTuner, numpy's global seed).
        map_num_proc: Processes for the shuffle's ``flatten_indices`` (as XTuner).
        plan: Where rows are cut (see :func:`packed_tables`).

    Returns:
        The packed ``datasets.Dataset``.

    Raises:
        ValueError: a column XTuner packs is missing.
    """
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    missing = {"input_ids", "labels"} - set(dataset.column_names)
    if missing:
        raise ValueError(
            f"pack_dataset: the tokenized dataset has no column(s) {sorted(missing)} "
            f"(columns: {dataset.column_names}); pack_to_max_length needs "
            "tokenized dialogues (input_ids and labels)."
        )
    if shuffle_before_pack:
        dataset = dataset.shuffle()
        dataset = dataset.flatten_indices(num_proc=map_num_proc)
    table = dataset.with_format("arrow")[:]  # zero-copy slices of the cache files
    path = _output_path(dataset)
    with ArrowWriter(path=str(path)) as writer:
        for part in packed_tables(table, max_length, use_varlen_attn, plan):
            writer.write_table(part)
        writer.finalize()
    packed = Dataset.from_file(str(path))
    tokens, labels = _token_counts(table)
    print_log(
        f"xtuner-rope: packed {len(dataset)} dialogues ({tokens} tokens, {labels} "
        f"supervised labels) into {len(packed)} rows of max_length={max_length}; "
        "nothing dropped.",
        logger="current",
    )
    return packed


def _token_counts(table: pa.Table) -> tuple[int, int]:
    """Tokens and labels other than -100 (XTuner's IGNORE_INDEX) of a tokenized table."""
    labels = pc.list_flatten(table.column("labels"))
    return len(pc.list_flatten(table.column("input_ids"))), int(
        pc.sum(pc.not_equal(labels, -100)).as_py() or 0
    )


def lossless_process_hf_dataset(dataset, **kwargs):
    """``xtuner.dataset.process_hf_dataset`` (same arguments) whose packing drops nothing.

    The start-up puts it in place of ``process_hf_dataset`` in packing configs. XTuner's own
    function runs, distributed start included; only its pack step is this module's
    :func:`pack_dataset`.

    Args:
        dataset: As ``process_hf_dataset``.
        **kwargs: As ``process_hf_dataset``.

    Returns:
        The dataset ``process_hf_dataset`` builds, with every dialogue's tokens kept.
    """
    from xtuner.dataset.huggingface import process_hf_dataset

    from xtuner_rope.compat import xtuner_pack_step

    with xtuner_pack_step(pack_dataset):
        return process_hf_dataset(dataset, **kwargs)


__all__ = ["lossless_process_hf_dataset", "pack_dataset", "pack_plan"]
