"""The documents of XTuner's tokenized intern-repo files (``.bin``) parsed a packed row at a time.

XTuner's ``JsonlDataset`` reads one document by seeking its memory-mapped file to the line's
offset, ``json.loads`` the line ``{"tokens": [...]}`` and builds ``input_ids`` (each token's
absolute value) and ``labels`` (the token where positive, else -100) with two Python list
comprehensions: about 0.3 us a token, a ceiling near 2M tokens/s for a reading process. Here
the lines of all the documents of one row are joined and their integers parsed in one pass of
numpy over the bytes. The fast path takes only lines it can parse exactly as ``json.loads``
does (a strict subset of JSON, checked byte by byte); for any other line the caller reads the
row through XTuner's reader, so no row differs from XTuner's reading.
"""

from __future__ import annotations

import mmap

import numpy as np

from .pack_plans import token_indices

__all__ = ["TokenLines", "parse_int_lists"]

# The line starts json.dumps writes with its default separators and with compact ones; a line
# is ``PREFIX + body + SUFFIX``, optionally followed by its newline.
PREFIXES = (b'{"tokens": [', b'{"tokens":[')
SUFFIX = b"]}"
MAX_DIGITS = 18  # every 18-digit integer fits int64; a longer one goes the slow way
_COMMA, _MINUS, _SPACE, _ZERO = 44, 45, 32, 48
_PAD = 24  # spaces before the text: 8 bytes ending at any digit of an 18-digit number exist
# _TOP[k]: the top k bytes of a little-endian uint64 (the k digits that end a number)
_TOP = np.array([0] + [((1 << 8 * k) - 1) << 8 * (8 - k) for k in range(1, 9)], np.uint64)
_ZEROS = np.uint64(0x3030303030303030)  # b"00000000"


def parse_int_lists(bodies: list[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
    """The integers of JSON array bodies (``1, -2, 3``), parsed together, as ``json.loads`` reads them.

    Accepted: per body, one or more integers (an optional ``-``, no leading zero, at most 18
    digits) separated by commas, spaces around them; nothing else (no other whitespace, no
    floats, no empty body). Any body outside that grammar makes the whole call return None,
    never a different number.

    Args:
        bodies: ``[k]`` the bytes between a line's ``[`` and ``]``.

    Returns:
        ``(values, counts)``: ``[t]`` int64, the integers of every body in order, and ``[k]``
        how many each body holds; None where some body is outside the accepted grammar.
    """
    if not bodies:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # framed in commas: every number sits between two commas
    text = b" " * _PAD + b"," + b",".join(bodies) + b","
    numbers = _numbers(np.frombuffer(text, dtype=np.uint8))
    if numbers is None:
        return None
    starts, ends, negative = numbers
    values = _decimal_values(text, ends, ends - starts)
    values = np.where(negative, -values, values)
    # body k holds the numbers between its two framing commas
    sizes = np.fromiter(map(len, bodies), dtype=np.int64, count=len(bodies))
    edges = _PAD + np.concatenate([[0], np.cumsum(sizes + 1)])  # [k + 1] framing commas
    return values, np.diff(np.searchsorted(starts, edges))


def _numbers(f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``[t]`` first digit, one past the last digit and sign of each number of the text ``f``
    (``[L]`` bytes: spaces, then numbers between commas), or None outside the grammar."""
    d = f - np.uint8(_ZERO)  # [L] digit values; any other byte wraps above 9
    digit = d < 10
    comma, minus, space = f == _COMMA, f == _MINUS, f == _SPACE
    if not (digit | comma | minus | space).all():
        return None
    # framed in non-digits: digit runs start and end at alternate digit/non-digit edges
    edges = np.flatnonzero(digit[1:] != digit[:-1]) + 1
    starts, ends = edges[0::2], edges[1::2]
    width = ends - starts
    commas = np.flatnonzero(comma)
    if len(commas) != len(starts) + 1:
        return None
    if not ((commas[:-1] < starts) & (starts < commas[1:])).all():  # one number between commas
        return None
    if width.max(initial=0) > MAX_DIGITS or ((d[starts] == 0) & (width > 1)).any():
        return None
    signs = np.flatnonzero(minus)  # a sign: after a comma or space, right before a digit
    if not (digit[signs + 1].all() and (comma[signs - 1] | space[signs - 1]).all()):
        return None
    return starts, ends, minus[starts - 1]


def _decimal_values(text: bytes, ends: np.ndarray, width: np.ndarray) -> np.ndarray:
    """``[t]`` int64 values of the digit runs of ``text`` ending at ``ends``, ``width`` digits
    each, eight digits at a time: the 8 bytes ending at a run read as one little-endian
    uint64 (the first digit in the lowest byte), digits paired, then quadrupled, then eight."""
    # [L - 7] every byte offset's 8 bytes as an (unaligned) uint64, no copy
    windows = np.ndarray((len(text) - 7,), dtype="<u8", buffer=text, strides=(1,))
    values = np.zeros(len(ends), np.int64)
    for place in range(0, int(width.max(initial=1)), 8):  # 18 digits: at most 3 rounds
        top = _TOP[np.clip(width - place, 0, 8)]  # the run's digits; bytes before it: 0
        v = (windows[ends - place - 8] & top) - (_ZEROS & top)  # no borrow: each byte >= "0"
        v = (v * np.uint64(10) + (v >> np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
        v = (v * np.uint64(100) + (v >> np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
        v = (v * np.uint64(10000) + (v >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
        values += v.astype(np.int64) * 10**place
    return values


class TokenLines:
    """The lines of one XTuner ``JsonlDataset``'s file, read straight from its own mapping.

    Args:
        path: The ``.bin`` file (``JsonlDataset.path``).
        offsets: ``[n]`` byte offset of each document's line (``JsonlDataset.offsets``).
        lengths: ``[n]`` tokens of each document per the ``.meta`` index
            (``JsonlDataset.length``); a line holding another count goes the slow way.
    """

    def __init__(self, path: str, offsets: np.ndarray, lengths: np.ndarray) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lengths = np.asarray(lengths, dtype=np.int64)

    def pieces(
        self, documents: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """``input_ids`` and ``labels`` of tokens ``offsets[i] .. offsets[i] + sizes[i]`` of
        each ``documents[i]``, one piece after another, as XTuner's reader makes them.

        Args:
            documents: ``[p]`` document indices (into ``JsonlDataset``).
            offsets: ``[p]`` first token of each piece in its document.
            sizes: ``[p]`` tokens of each piece.

        Returns:
            ``(input_ids, labels)``, each ``[sum(sizes)]`` int64; None where a line is not in
            the form parsed here (the caller reads the row through XTuner's reader).
        """
        bodies = []
        for at in self._offsets[documents].tolist():
            end = self._map.find(b"\n", at)
            line = self._map[at : end if end >= 0 else len(self._map)]
            if not (line.startswith(PREFIXES) and line.endswith(SUFFIX)):
                return None
            bodies.append(line[line.index(b"[") + 1 : -len(SUFFIX)])  # the prefix's ``[``
        parsed = parse_int_lists(bodies)
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
