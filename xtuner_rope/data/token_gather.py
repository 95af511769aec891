"""Gather token ranges from a tokenized Arrow column without joining its chunks.

A tokenized ``datasets`` table is memory-mapped from its cache files in record batches (a
thousand dialogues each, as ``datasets.map`` writes them). Rows packed whole take their
dialogues from anywhere in it, but ``ChunkedArray.take`` (pyarrow 26 still) first joins every
chunk into one array: a copy of the whole column in memory, 0.4 GiB for 50M int64 tokens.
Here each chunk stays a zero-copy numpy view of the mapped file and a gather reads, chunk by
chunk, only the pieces that lie in it (a dialogue never spans two chunks).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .pack_plans import token_indices

__all__ = [
    "TokenGather",
    "drop_mapped_pages",
    "read_only_mappings",
    "release_pages",
    "table_and_order",
]

MADV_DONTNEED = 4  # Linux <sys/mman.h>


class TokenGather:
    """Pieces of the flattened token stream of list columns, gathered chunk by chunk.

    Args:
        table: A table of list columns (one row per dialogue), chunked as it was mapped.
        columns: The columns to gather (each flattened to one token stream).
        mapped_files: The files ``table`` is memory-mapped from: each chunk's pages are
            released as soon as a gather has read it, so the process never holds the whole
            tokenized table resident (every gather reads from nearly every page).
    """

    def __init__(
        self, table: pa.Table, columns: tuple[str, ...], mapped_files: tuple[str, ...] = ()
    ) -> None:
        # One chunk layout for every column (record batches: zero-copy slices of the columns).
        table = pa.Table.from_batches(table.select(list(columns)).to_batches())
        flat = {k: pc.list_flatten(table.column(k)) for k in columns}
        self._chunks = {
            k: [c.to_numpy(zero_copy_only=False) for c in v.chunks] for k, v in flat.items()
        }
        sizes = [len(c) for c in self._chunks[columns[0]]]
        for k in columns[1:]:
            if [len(c) for c in self._chunks[k]] != sizes:
                raise ValueError(
                    f"pack_dataset: column {k!r} holds a different number of tokens than "
                    f"{columns[0]!r} in some dialogue (expected one {k} per token); "
                    "check the tokenize step of the dataset."
                )
        self._chunk_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        mappings = read_only_mappings(list(mapped_files))
        self._mapped = {
            k: [
                any(lo <= c.ctypes.data and c.ctypes.data + c.nbytes <= hi for lo, hi in mappings)
                for c in chunks
            ]
            for k, chunks in self._chunks.items()
        }

    def gather(self, starts: np.ndarray, sizes: np.ndarray) -> dict[str, np.ndarray]:
        """The tokens of the pieces ``starts[i] .. starts[i] + sizes[i]``, one after another.

        Args:
            starts: ``[p]`` offsets of the pieces into the flattened stream.
            sizes: ``[p]`` lengths of the pieces (each inside one dialogue).

        Returns:
            Per column, ``[sum(sizes)]`` tokens, the pieces in the given order.
        """
        starts = np.asarray(starts, dtype=np.int64)
        sizes = np.asarray(sizes, dtype=np.int64)
        chunk = np.searchsorted(self._chunk_starts, starts, side="right") - 1
        dest = np.cumsum(sizes) - sizes
        out = {k: np.empty(int(sizes.sum()), dtype=v[0].dtype) for k, v in self._chunks.items()}
        by_chunk = np.argsort(chunk, kind="stable")
        edges = np.flatnonzero(np.diff(chunk[by_chunk])) + 1
        for part in np.split(by_chunk, edges) if len(by_chunk) else []:
            c = int(chunk[part[0]])
            to = token_indices(dest[part], sizes[part])
            src = token_indices(starts[part] - self._chunk_starts[c], sizes[part])
            for k, chunks in self._chunks.items():
                out[k][to] = chunks[c][src]
                if self._mapped[k][c]:
                    release_pages(chunks[c].ctypes.data, chunks[c].nbytes)
        return out

    def row(self, starts: np.ndarray, sizes: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`gather` for the few pieces of one packed row: their slices joined, in order
        (no sort by chunk, nothing released: a data loader reads rows this way).

        Args:
            starts: ``[p]`` offsets of the pieces into the flattened stream.
            sizes: ``[p]`` lengths of the pieces (each inside one dialogue).

        Returns:
            Per column, ``[sum(sizes)]`` tokens, the pieces in the given order.
        """
        chunk = np.searchsorted(self._chunk_starts, starts, side="right") - 1
        local = (np.asarray(starts) - self._chunk_starts[chunk]).tolist()
        pieces = list(zip(chunk.tolist(), local, np.asarray(sizes).tolist()))
        return {
            k: np.concatenate([chunks[c][a : a + n] for c, a, n in pieces] or [chunks[0][:0]])
            for k, chunks in self._chunks.items()
        }


def table_and_order(dataset) -> tuple[pa.Table, np.ndarray | None]:
    """A ``datasets.Dataset``'s table as it is held (mapped or in memory, zero-copy) and, if it
    is shuffled or selected, ``[n]`` the table row of each of its rows (else None).

    Reading through the indices never writes the shuffle out, nor takes the whole column
    (``ChunkedArray.take`` joins every chunk first).
    """
    # ``_indices`` is how datasets 2.x-5.x keep a shuffle or selection (no public accessor).
    indices = getattr(dataset, "_indices", None)
    if indices is None:
        return dataset.data.table, None
    return dataset.data.table, indices.column(0).to_numpy(zero_copy_only=False).astype(np.int64)


def read_only_mappings(paths: list[str]) -> list[tuple[int, int]]:
    """``(start, end)`` addresses of this process's read-only mappings of the files ``paths``.

    Only mappings no one can write through: dropping their pages loses nothing (the next
    read faults them in again from the file or the page cache). Empty off Linux.
    """
    if not sys.platform.startswith("linux") or not paths:
        return []
    names = {os.path.realpath(p) for p in paths}
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "w" not in fields[1] and fields[5].rstrip("\n") in names:
                found.append(tuple(int(x, 16) for x in fields[0].split("-")))
    return found


def release_pages(start: int, nbytes: int) -> None:
    """``MADV_DONTNEED`` the pages of ``[start, start + nbytes)``: only for read-only mappings
    of a file (``read_only_mappings``), where it unmaps pages without losing any data."""
    page = mmap.PAGESIZE
    lo = start // page * page
    hi = -(-(start + nbytes) // page) * page
    _madvise(lo, hi - lo, MADV_DONTNEED)


def drop_mapped_pages(paths: list[str]) -> None:
    """Drop this process's resident pages of its read-only mappings of the files ``paths``.

    A memory-mapped table keeps every page read counted in the process's resident memory
    though the kernel may reclaim it. Linux only; elsewhere nothing is done.

    Args:
        paths: Files whose mappings to release (a dataset's cache files).
    """
    for lo, hi in read_only_mappings(paths):
        _madvise(lo, hi - lo, MADV_DONTNEED)


@functools.cache
def _libc_madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _madvise(start: int, length: int, advice: int) -> None:
    _libc_madvise()(start, length, advice)
