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
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["TokenGather", "drop_mapped_pages", "ranges"]

MADV_DONTNEED = 4  # Linux <sys/mman.h>


def ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``[sum(sizes)]`` the integers ``start .. start + size - 1`` of each range, in order."""
    starts = np.asarray(starts, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    first = np.cumsum(sizes) - sizes
    return np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(starts - first, sizes)


class TokenGather:
    """Pieces of the flattened token stream of list columns, gathered chunk by chunk.

    Args:
        table: A table of list columns (one row per dialogue), chunked as it was mapped.
        columns: The columns to gather (each flattened to one token stream).
    """

    def __init__(self, table: pa.Table, columns: tuple[str, ...]) -> None:
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
            to = ranges(dest[part], sizes[part])
            src = ranges(starts[part] - self._chunk_starts[c], sizes[part])
            for k, chunks in self._chunks.items():
                out[k][to] = chunks[c][src]
        return out


def drop_mapped_pages(paths: list[str]) -> None:
    """Drop this process's resident pages of its read-only mappings of the files ``paths``.

    The tokenized table is memory-mapped: every page a gather reads stays counted in the
    process's resident memory (the whole tokenized size by the end of a pack, 0.8 GiB at a
    million dialogues) though the kernel may reclaim it. ``MADV_DONTNEED`` on a mapping that
    cannot be written only unmaps its pages: the next read faults them in again from the file
    (or the page cache). Linux only; elsewhere nothing is done.

    Args:
        paths: Files whose mappings to release (the dataset's cache files).
    """
    if not sys.platform.startswith("linux") or not paths:
        return
    names = {os.path.realpath(p) for p in paths}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            # Only mappings of those files that no one can write through: nothing to lose.
            if len(fields) == 6 and "w" not in fields[1] and fields[5].rstrip("\n") in names:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                libc.madvise(lo, hi - lo, MADV_DONTNEED)
