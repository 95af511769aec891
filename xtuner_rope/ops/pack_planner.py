"""Best-fit decreasing over item lengths, equal lengths placed in bulk.

The best-fit row with room ``r`` takes ``r // L`` items of length ``L`` at once; rows of equal
room share a bucket, those with room ``>= L`` in a min-heap (*fitting*), the others in a
max-heap (*waiting*). Same rows as placing items one at a time (ties by index); ``O(n log n)``.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["best_fit_decreasing"]


def best_fit_decreasing(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Group whole items (``lengths`` ``[n]``, each in ``[1, max_length]``, checked by the
    caller) into rows of at most ``max_length`` tokens by best-fit decreasing.

    Returns:
        ``(items, row_offsets)``: ``[n]`` int64 item indices row after row (index order within a
        row, rows by their longest item), and ``[r + 1]`` int64 offsets of each row into ``items``.
    """
    lengths = np.asarray(lengths).reshape(-1)  # any integer dtype: [n] arrays are the memory
    if lengths.dtype.kind not in "iu":
        lengths = lengths.astype(np.int64)
    if not len(lengths):
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    key = -lengths if lengths.dtype.kind == "i" else -lengths.astype(np.int64)
    order = np.argsort(key, kind="stable")  # longest first, ties by index
    del key
    descending = lengths[order]
    first = np.flatnonzero(np.r_[True, descending[1:] != descending[:-1]])  # each group's start
    counts = np.diff(np.append(first, len(order)))
    group_lengths = descending[first].tolist()
    del descending
    # Each group fills rows in turn: ``filled`` lists (row, items it takes) in placing order.
    filled_rows: list[int] = []
    filled_counts: list[int] = []
    n_rows = _place(group_lengths, counts.tolist(), int(max_length), filled_rows, filled_counts)
    row_dtype = np.int32 if n_rows < 2**31 else np.int64
    row_of = np.repeat(np.asarray(filled_rows, dtype=row_dtype), filled_counts)  # per order[i]
    del filled_rows, filled_counts
    by_row = np.lexsort((order, row_of))
    row_offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=n_rows), out=row_offsets[1:])
    return order[by_row], row_offsets


def _place(
    lengths: list[int], counts: list[int], max_length: int, rows_out: list, counts_out: list
) -> int:
    """Place ``counts[g]`` items of ``lengths[g]`` (descending) group by group, appending to
    ``rows_out``/``counts_out`` which row takes how many consecutive items.
    """
    fitting: list[int] = []  # min-heap of rooms >= the current length
    waiting: list[int] = []  # max-heap (negated) of rooms < the current length
    rows_with: dict[int, list[int]] = {}  # room -> its rows, last to arrive at the end
    n_rows = 0
    for need, left in zip(lengths, counts, strict=True):
        while waiting and -waiting[0] >= need:  # shorter items: these rooms fit now
            heapq.heappush(fitting, -heapq.heappop(waiting))
        while left:
            if not fitting:  # no row fits: open rows, each taking as many as fit
                per_row = max_length // need
                full, last = divmod(left, per_row)
                new = list(range(n_rows, n_rows + full + (last > 0)))
                n_rows += len(new)
                rows_out.extend(new)
                counts_out.extend([per_row] * full + ([last] if last else []))
                _file(rows_with, fitting, waiting, need, max_length - per_row * need, new[:full])
                if last:
                    _file(rows_with, fitting, waiting, need, max_length - last * need, new[full:])
                break
            room = fitting[0]
            stack = rows_with[room]
            per_row = room // need
            take = min(len(stack), -(-left // per_row))  # rows this bucket gives the group
            taken = stack[-take:][::-1]  # last in, first out
            del stack[-take:]
            if not stack:
                heapq.heappop(fitting)
                del rows_with[room]
            full = min(take, left // per_row)
            last = left - full * per_row if full < take else 0
            rows_out.extend(taken)
            counts_out.extend([per_row] * full + ([last] if last else []))
            left -= full * per_row + last
            _file(rows_with, fitting, waiting, need, room - per_row * need, taken[:full])
            if last:
                _file(rows_with, fitting, waiting, need, room - last * need, taken[full:])
    return n_rows


def _file(rows_with: dict, fitting: list, waiting: list, need: int, room: int, rows: list) -> None:
    """Put ``rows`` (now with ``room`` free) into their bucket; full rows leave for good."""
    if not rows or not room:
        return
    stack = rows_with.get(room)
    if stack is None:
        rows_with[room] = stack = []
        if room >= need:
            heapq.heappush(fitting, room)
        else:
            heapq.heappush(waiting, -room)
    stack.extend(rows)
