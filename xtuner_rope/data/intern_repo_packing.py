"""XTuner's intern-repo packing (``build_packed_dataset``) with every document whole.

:class:`WholePackedDataset`: XTuner's arguments and shuffle, each document whole in one row
(longer ones split), nothing dropped.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import pyarrow.compute as pc
import torch
from mmengine.logging import print_log

from .pack_plans import cut_dialogues, intern_repo_cut_plan, whole_plan
from .token_gather import TokenGather, table_and_order
from .token_lines import TokenLines
from .truncation import counting_truncation, summed_figures, tokenized_line, truncation_message

COLUMNS = ("input_ids", "labels")
UNTOKENIZED = "load_intern_repo_untokenized_dataset"  # the loader whose encode_fn cuts


def _lengths(dataset) -> np.ndarray:
    """``[n]`` document lengths: a ``JsonlDataset``'s ``.meta`` index, or the Arrow column."""
    from datasets import Dataset

    length = getattr(dataset, "length", None)
    if length is None and isinstance(dataset, Dataset):
        table, order = table_and_order(dataset)
        length = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
        length = length if order is None else length[order]
    if length is None:
        length = [len(item["input_ids"]) for item in dataset]
    return np.asarray(length, dtype=np.int64)


def _table_token_starts(dataset, documents: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``[p]`` offsets of the pieces into the flattened token stream of a dataset's table."""
    table, order = table_and_order(dataset)
    sizes = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    doc_starts = np.cumsum(sizes, dtype=np.int64) - sizes
    rows = documents if order is None else order[documents]
    return doc_starts[rows] + offsets


class WholePackedDataset(torch.utils.data.Dataset):
    """XTuner's intern-repo ``PackedDataset`` (same arguments), each document whole in a row.

    Holds the plan only (~40 bytes a document); rows are read on access (``token_lines`` for a
    ``JsonlDataset``, ``token_gather`` for a ``datasets.Dataset``).

    Args:
        truncation: ``counting_truncation``'s list of what ``encode_fn`` cut, or None.

    Raises:
        ValueError: ``packed_length`` is not a positive integer, or a document is empty.
    """

    def __init__(
        self, dataset, packed_length: int = 8192, seed: int = 1024, truncation: list | None = None
    ):
        from datasets import Dataset

        self.dataset = dataset
        self.packed_length = packed_length
        self.length = _lengths(dataset)
        order = np.arange(len(self.length))
        np.random.RandomState(seed).shuffle(order)  # XTuner's shuffle, same seed
        self.shuffled_indices = order  # [n] the stream order (XTuner's attribute, a list there)
        lengths = self.length[order]
        starts, self.sizes, self.row_pieces = whole_plan(lengths, packed_length)
        stream = np.cumsum(lengths) - lengths  # [n] each shuffled document's stream offset
        at = np.searchsorted(stream, starts, side="right") - 1  # [p] piece -> shuffled document
        self.documents = order[at]  # [p] index into ``dataset`` of each piece
        self.offsets = starts - stream[at]  # [p] first token of each piece in its document
        self.token_starts = (
            _table_token_starts(dataset, self.documents, self.offsets)
            if isinstance(dataset, Dataset)
            else None
        )
        self._gather = None  # built in the process that reads rows, never pickled
        self._lines = None  # likewise (a mapping of the ``.bin`` file)
        self.num_tokens = int(self.length.sum())
        cut = any(truncation_message(f) for f in truncation or [])  # lost before packing
        line = _summary(lengths, len(self), packed_length, _unit(dataset), cut)
        print_log(line, logger="current")

    def __len__(self) -> int:
        return len(self.row_pieces) - 1

    def __getstate__(self) -> dict:
        # views of the table, a mapping of the file: rebuilt where read
        return {**self.__dict__, "_gather": None, "_lines": None}

    def __getitem__(self, row: int) -> dict:
        """Row ``row``: XTuner's packed columns, positions restarting at 0 per document."""
        pieces = slice(self.row_pieces[row], self.row_pieces[row + 1])
        sizes = self.sizes[pieces]
        ids, labels = self._tokens(pieces, sizes)
        cumulative_len = np.concatenate([[0], np.cumsum(sizes)])
        return {
            "input_ids": ids,
            "cumulative_len": cumulative_len.tolist(),
            "position_ids": (np.arange(len(ids)) - np.repeat(cumulative_len[:-1], sizes)).tolist(),
            "labels": labels,
        }

    def _tokens(self, pieces: slice, sizes: np.ndarray) -> tuple[list, list]:
        """``input_ids`` and ``labels`` of the row's pieces, joined."""
        if self.token_starts is not None:
            if self._gather is None:
                self._gather = TokenGather(table_and_order(self.dataset)[0], COLUMNS)
            tokens = self._gather.row(self.token_starts[pieces], sizes)
            return tokens["input_ids"].tolist(), tokens["labels"].tolist()
        documents, offsets = self.documents[pieces], self.offsets[pieces]
        if self._lines is None:
            self._lines = _token_lines(self.dataset)
        parsed = self._lines.pieces(documents, offsets, sizes) if self._lines else None
        if parsed is not None:
            return parsed[0].tolist(), parsed[1].tolist()
        return pieces_by_reader(self.dataset, documents, offsets, sizes)


def pieces_by_reader(dataset, documents, offsets, sizes) -> tuple[list, list]:
    """``(input_ids, labels)`` of the pieces (``[p]`` documents, first tokens ``offsets``,
    ``sizes``) read through ``dataset[i]`` (XTuner's reader), joined."""
    ids, labels = [], []
    for doc, a, n in zip(documents, offsets, sizes):
        sample = dataset[int(doc)]
        ids.extend(sample["input_ids"][a : a + n])
        labels.extend(sample["labels"][a : a + n])
    return ids, labels


def _token_lines(dataset) -> TokenLines | bool:
    """A bulk reader of the lines of XTuner's own ``JsonlDataset`` (not a subclass), else False."""
    from xtuner.dataset.intern_repo import JsonlDataset

    if type(dataset) is not JsonlDataset:
        return False
    return TokenLines(dataset.path, dataset.offsets, dataset.length)


def _unit(dataset) -> str:
    """``dialogues`` where some label is -100 (prompts), else ``documents``."""
    table = getattr(dataset, "data", None)
    if table is None or "labels" not in getattr(table, "column_names", ()):
        return "documents"
    labels = pc.list_flatten(table.column("labels"))
    return "dialogues" if pc.any(pc.equal(labels, -100)).as_py() else "documents"


def _summary(
    lengths: np.ndarray, rows: int, packed_length: int, what: str = "documents", cut: bool = False
) -> str:
    """The start-up's line on one file's packing, with XTuner's cut for comparison."""
    cuts = intern_repo_cut_plan(lengths, packed_length)
    tokens, long = int(lengths.sum()), lengths[lengths > packed_length]
    split, pieces = len(long), int((-(-long // packed_length)).sum())
    return (
        f"xtuner-rope: packed {len(lengths)} {what} ({tokens} tokens) into {rows} rows of "
        f"packed_length={packed_length} (fill {tokens / max(rows * packed_length, 1):.1%}), "
        f"every {what[:-1]} whole in one row"
        + (
            f" ({split} documents longer than a row split into {pieces} packed_length pieces)"
            if split
            else ""
        )
        + (", nothing dropped by packing" if cut else ", nothing dropped")
        + f". XTuner's PackedDataset would make {len(cuts) - 1} rows, cut "
        f"{cut_dialogues(lengths, cuts)} {what} and drop {tokens - int(cuts[-1])} tokens: "
        + (
            f"an epoch is {rows} rows instead of {len(cuts) - 1} (iterations per epoch change "
            "with it)."
            if rows != len(cuts) - 1
            else "an epoch has as many rows."
        )
    )


def build_whole_packed_dataset(*args, whole_documents: bool = True, **kwargs):
    """``xtuner.dataset.intern_repo.build_packed_dataset`` (same arguments), documents whole
    (``whole_documents=False``: XTuner's own packer); ``encode_fn``'s cut counted in one line.

    Raises:
        TypeError: ``whole_documents`` is not a bool.
    """
    from xtuner.dataset.intern_repo import build_packed_dataset

    from xtuner_rope.compat.xtuner_packing import xtuner_intern_repo_packer

    if not isinstance(whole_documents, bool):
        raise TypeError(
            f"build_whole_packed_dataset: whole_documents: expected True or False, got "
            f'{whole_documents!r}; set offline_packing = "whole" or "cut" at the top level of '
            "the config instead."
        )
    with counting_truncation() as truncation:  # the untokenized loader's encode_fn cut
        if not whole_documents:
            built = build_packed_dataset(*args, **kwargs)
        else:
            packer = functools.partial(WholePackedDataset, truncation=truncation)
            with xtuner_intern_repo_packer(packer):
                built = build_packed_dataset(*args, **kwargs)
    figures = summed_figures(truncation)  # None: tokenized files, nothing cut at max_length
    if figures is not None:
        figures["builder"] = UNTOKENIZED
        level = logging.WARNING if truncation_message(figures) else logging.INFO
        print_log(tokenized_line(figures), logger="current", level=level)
    return built


__all__ = ["WholePackedDataset", "build_whole_packed_dataset"]
