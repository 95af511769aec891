"""The documents of XTuner's tokenized intern-repo files (``.bin``) parsed a packed row at a time.

One pyarrow JSON read per row with an explicit ``list<int64>`` schema; a row it refuses is
read through XTuner's own reader.
"""

from __future__ import annotations

import io
import mmap

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json

from .pack_plans import token_indices

__all__ = ["TokenLines", "parse_token_lines"]

_SCHEMA = pa.schema([("tokens", pa.list_(pa.int64()))])
_PARSE = pa_json.ParseOptions(explicit_schema=_SCHEMA, unexpected_field_behavior="ignore")
_INT64_MIN = np.iinfo(np.int64).min


def parse_token_lines(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
    """The ``tokens`` of ``[k]`` JSON lines, read together, as ``json.loads(line)["tokens"]``.

    Returns:
        ``(values, counts)``: ``[t]`` int64 values in order and ``[k]`` counts; None where a
        line is not one object with a ``tokens`` list of integers (or holds int64's lowest).
    """
    if not lines:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if any(b"\n" in line for line in lines):  # one line, one record
        return None
    text = b"\n".join(lines)
    # a block holds the whole row: one parse, no thread hand-off for a few kilobytes
    options = pa_json.ReadOptions(use_threads=False, block_size=max(len(text) + 1, 1 << 16))
    try:
        table = pa_json.read_json(io.BytesIO(text), read_options=options, parse_options=_PARSE)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    column = table.column("tokens").combine_chunks()
    if len(column) != len(lines) or column.null_count or column.values.null_count:
        return None  # two objects on a line, a missing or null list, a null element
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy()[offsets[0] : offsets[-1]]
    if (values == _INT64_MIN).any():  # its absolute value (input_ids) is beyond int64
        return None
    return values, np.diff(offsets)


class TokenLines:
    """The lines of one XTuner ``JsonlDataset``'s file (``path``, ``offsets``), read straight from
    its own mapping; a line whose count differs from ``lengths`` (the ``.meta`` index) goes the
    slow way."""

    def __init__(self, path: str, offsets: np.ndarray, lengths: np.ndarray) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lengths = np.asarray(lengths, dtype=np.int64)

    def pieces(
        self, documents: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """``(input_ids, labels)``, each ``[sum(sizes)]`` int64, of the pieces (``[p]`` documents,
        first tokens ``offsets``, ``sizes``) as XTuner's reader makes them; None where a line is
        not in the form parsed here."""
        lines = []
        for at in self._offsets[documents].tolist():
            end = self._map.find(b"\n", at)
            lines.append(self._map[at : end if end >= 0 else len(self._map)])
        parsed = parse_token_lines(lines)
        if parsed is None or (parsed[1] != self._lengths[documents]).any():
            return None
        values, counts = parsed
        tokens = values  # most rows: whole documents, every value once in order
        if (np.asarray(offsets) != 0).any() or (counts != sizes).any():
            first = np.cumsum(counts) - counts  # [p] each line's first value
            tokens = values[token_indices(first + np.asarray(offsets), sizes)]
        return np.abs(tokens), np.where(tokens > 0, tokens, -100)

    def close(self) -> None:
        """Unmap the file."""
        self._map.close()
