"""Gather token ranges from a tokenized Arrow column without joining its chunks.

Chunks stay zero-copy views of the mapped file, read a window at a time; the pages read are
released (docs/measurements.md) unless ``XTUNER_ROPE_RELEASE_PAGES=0``.
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
    "RELEASE_PAGES_ENV",
    "TokenGather",
    "drop_mapped_pages",
    "list_lengths",
    "read_only_mappings",
    "release_pages",
    "releases_pages",
    "table_and_order",
]

RELEASE_PAGES_ENV = "XTUNER_ROPE_RELEASE_PAGES"
MADV_DONTNEED = 4  # Linux <sys/mman.h>
WINDOW_BYTES = 32 << 20  # file bytes per window: the resident pages of a gather stay below
# Chunks whose offsets are read between two releases of the mapped pages. A read of a few
# bytes maps its neighbours too (the kernel's fault-around, 64 KiB): reading every chunk's
# offsets would leave 1.3 GiB of an 8 GiB table resident at 10M dialogues.
RELEASE_EVERY = 256


class TokenGather:
    """Pieces of the flattened token stream of a table's list ``columns``, gathered window by window.

    ``mapped_files``: the files ``table`` is memory-mapped from; chunks in a read-only mapping
    of one are read through one view of it, their pages released once read (if
    :func:`releases_pages`).

    Raises:
        ValueError: a column holds a different number of tokens than the first in some row.
    """

    def __init__(
        self, table: pa.Table, columns: tuple[str, ...], mapped_files: tuple[str, ...] = ()
    ) -> None:
        mappings = read_only_mappings(list(mapped_files))
        # One chunk layout for every column (record batches: zero-copy slices of the columns).
        table = pa.Table.from_batches(table.select(list(columns)).to_batches())
        self._chunks: dict[str, list[np.ndarray]] = {k: [] for k in columns}
        for i, batch in enumerate(table.to_batches()):
            for k in columns:  # zero-copy views; flattening reads the chunk's offsets
                flat = pc.list_flatten(batch.column(k))
                self._chunks[k].append(flat.to_numpy(zero_copy_only=False))
            if i % RELEASE_EVERY == RELEASE_EVERY - 1:
                _release_mappings(mappings)
        sizes = [len(c) for c in self._chunks[columns[0]]]
        for k in columns[1:]:
            if [len(c) for c in self._chunks[k]] != sizes:
                raise ValueError(
                    f"pack_dataset: column {k!r} holds a different number of tokens than "
                    f"{columns[0]!r} in some dialogue (expected one {k} per token); "
                    "check the tokenize step of the dataset."
                )
        self._chunk_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._windows = _Windows(self._chunks, mappings, table)
        _release_mappings(mappings)

    def gather(self, starts: np.ndarray, sizes: np.ndarray) -> dict[str, np.ndarray]:
        """Per column, ``[sum(sizes)]`` tokens of the pieces ``starts[i] .. starts[i] + sizes[i]``
        (``[p]`` offsets into the flattened stream, each inside one dialogue), in the given order."""
        starts = np.asarray(starts, dtype=np.int64)
        sizes = np.asarray(sizes, dtype=np.int64)
        chunk = np.searchsorted(self._chunk_starts, starts, side="right") - 1
        local = starts - self._chunk_starts[chunk]  # [p] first token in its chunk
        dest = np.cumsum(sizes) - sizes
        out = {k: np.empty(int(sizes.sum()), dtype=v[0].dtype) for k, v in self._chunks.items()}
        windows = self._windows
        window = windows.of_chunk[chunk]
        by_window = np.argsort(window, kind="stable")
        edges = np.flatnonzero(np.diff(window[by_window])) + 1
        for part in np.split(by_window, edges) if len(by_window) else []:
            w = int(window[part[0]])
            to = token_indices(dest[part], sizes[part])
            for k in out:
                view, first = windows.view(k, w, chunk[part])
                out[k][to] = view[token_indices(first + local[part], sizes[part])]
            windows.release(w)
        windows.release_mappings()  # pages mapped around the windows' edges (fault-around)
        return out

    def row(self, starts: np.ndarray, sizes: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`gather` for the few pieces of one packed row (no sort, nothing released)."""
        chunk = np.searchsorted(self._chunk_starts, starts, side="right") - 1
        local = (np.asarray(starts) - self._chunk_starts[chunk]).tolist()
        pieces = list(zip(chunk.tolist(), local, np.asarray(sizes).tolist()))
        return {
            k: np.concatenate([chunks[c][a : a + n] for c, a, n in pieces] or [chunks[0][:0]])
            for k, chunks in self._chunks.items()
        }


class _Windows:
    """Which window each chunk is read in: runs of chunks in one mapping within ``WINDOW_BYTES``."""

    def __init__(self, chunks: dict[str, list[np.ndarray]], mappings: list, table) -> None:
        columns = list(chunks)
        n = len(chunks[columns[0]])
        self.of_chunk = np.empty(n, dtype=np.int64)  # [chunks] window of each chunk
        self._chunks = chunks
        self._views: dict[tuple[str, int], np.ndarray] = {}  # (column, mapping) -> view
        self._first = {k: np.zeros(n, dtype=np.int64) for k in columns}  # element offsets
        self._mapping_of: list[int] = []  # per window: its mapping, or -1
        self._span: list[tuple[int, int]] = []  # per window: its bytes in the mapping
        self._mappings = mappings
        starts = np.asarray([lo for lo, _ in mappings], dtype=np.int64)
        for c in range(n):
            arrays = [chunks[k][c] for k in columns]
            m = _mapping_holding(arrays, mappings, starts)
            lo = min(a.ctypes.data for a in arrays)
            hi = max(a.ctypes.data + a.nbytes for a in arrays)
            span = self._span[-1] if self._span else None
            if m >= 0 and self._mapping_of[-1:] == [m] and hi - span[0] <= WINDOW_BYTES:
                self._span[-1] = (min(span[0], lo), max(span[1], hi))  # joins the window
            else:
                self._mapping_of.append(m)
                self._span.append((lo, hi))
            self.of_chunk[c] = len(self._span) - 1
            if m >= 0:
                for k, a in zip(columns, arrays):
                    view = self._views.get((k, m))
                    if view is None:
                        base, end = mappings[m]
                        buffer = pa.foreign_buffer(base, end - base, base=table)
                        view = np.frombuffer(buffer, dtype=a.dtype)
                        self._views[(k, m)] = view
                    self._first[k][c] = (a.ctypes.data - view.ctypes.data) // a.itemsize

    def view(self, column: str, window: int, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The array ``window`` reads ``column`` through, and ``[p]`` each piece's chunk offset in
        it."""
        m = self._mapping_of[window]
        if m < 0:
            return self._chunks[column][int(chunk[0])], np.zeros(len(chunk), dtype=np.int64)
        return self._views[(column, m)], self._first[column][chunk]

    def release_mappings(self) -> None:
        """Drop every resident page of the mappings the windows read."""
        _release_mappings(self._mappings)

    def release(self, window: int) -> None:
        """Drop the resident pages of a window read from a mapping (a no-op otherwise)."""
        if self._mapping_of[window] >= 0:
            lo, hi = self._span[window]
            release_pages(lo, hi - lo)


def _mapping_holding(arrays: list[np.ndarray], mappings: list, starts: np.ndarray) -> int:
    """The read-only mapping holding every one of ``arrays`` (contiguous, aligned), else -1."""
    if not len(starts):
        return -1
    found = set()
    for a in arrays:
        addr = a.ctypes.data
        m = int(np.searchsorted(starts, addr, side="right")) - 1
        if (
            m < 0
            or not a.size
            or not a.flags.c_contiguous
            or addr + a.nbytes > mappings[m][1]
            or (addr - mappings[m][0]) % a.itemsize
        ):
            return -1
        found.add(m)
    return found.pop() if len(found) == 1 else -1


def table_and_order(dataset) -> tuple[pa.Table, np.ndarray | None]:
    """A dataset's table as held (zero-copy) and ``[n]`` its rows' table rows if shuffled, else
    None."""
    # ``_indices`` is how datasets 2.x-5.x keep a shuffle or selection (no public accessor).
    indices = getattr(dataset, "_indices", None)
    if indices is None:
        return dataset.data.table, None
    return dataset.data.table, indices.column(0).to_numpy(zero_copy_only=False).astype(np.int64)


def read_only_mappings(paths: list[str]) -> list[tuple[int, int]]:
    """``(start, end)`` of this process's read-only mappings of ``paths`` (empty off Linux)."""
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


def releases_pages() -> bool:
    """Whether mapped pages are released once read: yes unless ``XTUNER_ROPE_RELEASE_PAGES`` is
    ``0`` / ``false`` / ``no`` / ``off`` (read at each release)."""
    value = os.environ.get(RELEASE_PAGES_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def release_pages(start: int, nbytes: int) -> None:
    """``MADV_DONTNEED`` the pages of ``[start, start + nbytes)`` (read-only file mappings only)."""
    if not releases_pages():
        return
    page = mmap.PAGESIZE
    lo = start // page * page
    hi = -(-(start + nbytes) // page) * page
    _libc_madvise()(lo, hi - lo, MADV_DONTNEED)


def list_lengths(column: pa.ChunkedArray, mapped_files: tuple[str, ...] = ()) -> np.ndarray:
    """``[n]`` lengths of a list column's rows (int32, int64 for ``large_list``), read chunk by
    chunk, pages of ``mapped_files`` released."""
    mappings = read_only_mappings(list(mapped_files))
    parts = []
    for i, chunk in enumerate(column.chunks):
        parts.append(pc.list_value_length(chunk).to_numpy(zero_copy_only=False))
        if i % RELEASE_EVERY == RELEASE_EVERY - 1:
            _release_mappings(mappings)
    _release_mappings(mappings)
    if not parts:
        return pc.list_value_length(column).to_numpy(zero_copy_only=False)
    return np.concatenate(parts)


def _release_mappings(mappings: list[tuple[int, int]]) -> None:
    if not releases_pages():
        return
    for lo, hi in mappings:
        _libc_madvise()(lo, hi - lo, MADV_DONTNEED)


def drop_mapped_pages(paths: list[str]) -> None:
    """Drop the resident pages of this process's read-only mappings of ``paths`` (Linux only)."""
    _release_mappings(read_only_mappings(paths))


@functools.cache
def _libc_madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise
