"""A dialogue's identity: one 128-bit hash of its token ids, with its length (numpy, vectorised)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["key_bytes", "segment_keys", "sequences_key_bytes"]

# Two odd 64-bit multipliers (golden ratio, and splitmix64's): each document's tokens hash to a
# 128-bit key with its length; a false match among a million documents has odds ~2**-88.
_HASH_BASES = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9))


def _mixed(tokens: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each token id (so that nearby ids hash far apart)."""
    z = tokens.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def segment_keys(tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``[k, 3]`` a key per segment of ``tokens`` ``[t]``: two 64-bit hashes and the length;
    ``starts`` ``[k]`` increasing, the first 0 (a segment runs to the next)."""
    sizes = np.diff(np.append(starts, len(tokens))).astype(np.int64)
    keys = np.zeros((len(starts), 3), dtype=np.uint64)
    keys[:, 2] = sizes.astype(np.uint64)
    if not len(tokens):
        return keys
    position = np.arange(len(tokens), dtype=np.int64) - np.repeat(starts, sizes)
    mixed = _mixed(tokens)
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 on purpose
        for j, base in enumerate(_HASH_BASES):
            powers = np.cumprod(np.full(int(sizes.max()), base, dtype=np.uint64))
            nonempty = sizes > 0
            keys[nonempty, j] = np.add.reduceat(mixed * powers[position], starts[nonempty])
    return keys


def key_bytes(tokens: np.ndarray, starts: np.ndarray) -> list[bytes]:
    """:func:`segment_keys` of each segment as 24 hashable bytes."""
    return [row.tobytes() for row in segment_keys(tokens, starts)]


def sequences_key_bytes(sequences: Iterable[Sequence[int]]) -> list[bytes]:
    """:func:`key_bytes` of whole sequences given one by one (``dataset['input_ids']``)."""
    arrays = [np.asarray(ids, dtype=np.int64).ravel() for ids in sequences]
    if not arrays:
        return []
    sizes = np.array([len(a) for a in arrays], dtype=np.int64)
    return key_bytes(np.concatenate(arrays), np.cumsum(sizes) - sizes)
