"""The counts every report of a cut shares: before / after / lost, and the ``max_length`` kept."""

from __future__ import annotations

import numpy as np

__all__ = ["FIRST_INDICES", "kept_counts", "length_quantile"]

FIRST_INDICES = 10  # truncated dialogues named in the report


def kept_counts(before: int, after: int) -> dict:
    """``{"before", "after", "lost"}``: a count before a cut, after it, and what it lost."""
    return {"before": int(before), "after": int(after), "lost": int(before) - int(after)}


def length_quantile(lengths, q: float) -> int | None:
    """The ``max_length`` that keeps a share ``q`` of ``lengths`` whole; None for no lengths."""
    lengths = np.asarray(lengths)  # the smallest length that at least a share q is <= to
    return int(np.quantile(lengths, q, method="inverted_cdf")) if len(lengths) else None
