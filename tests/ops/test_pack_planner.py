"""Bulk best-fit decreasing against the textbook one, placing one item at a time."""

import numpy as np
import pytest

from xtuner_rope.ops.pack_planner import best_fit_decreasing


def _one_at_a_time(lengths, max_length):
    """Textbook BFD: longest first (ties by index), each item into the row with the least room
    that fits it, among equal rooms the row that reached that room last; rows as lists."""
    rooms, arrived, rows = [], [], []
    for clock, i in enumerate(sorted(range(len(lengths)), key=lambda i: -lengths[i])):
        fits = [r for r in range(len(rows)) if rooms[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: (rooms[r], -arrived[r]))
        else:
            r = len(rows)
            rows.append([])
            rooms.append(max_length)
            arrived.append(clock)
        rows[r].append(i)
        rooms[r] -= lengths[i]
        arrived[r] = clock
    return [sorted(row) for row in rows]


def _rows(lengths, max_length):
    items, offsets = best_fit_decreasing(np.asarray(lengths), max_length)
    return [items[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


@pytest.mark.parametrize("seed", range(40))
def test_rows_are_those_of_placing_one_item_at_a_time(seed):
    rng = np.random.default_rng(seed)
    max_length = int(rng.choice([1, 7, 16, 100, 2048]))
    top = int(rng.choice([max_length, max(1, max_length // 3), max(1, max_length // 20)]))
    lengths = rng.integers(1, top + 1, int(rng.integers(0, 120))).tolist()
    assert _rows(lengths, max_length) == _one_at_a_time(lengths, max_length)


@pytest.mark.parametrize("max_length", [2**31 + 11, 2**62, 2**63 - 1])
def test_any_max_length(max_length):
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(1, 2**30, 50)] + [max_length, max_length // 2 + 1]
    assert _rows(lengths, max_length) == _one_at_a_time(lengths, max_length)


def test_equal_lengths_fill_rows_in_bulk():
    # 10 items of 3 in rows of 10: three rows of three items and one of one.
    assert _rows([3] * 10, 10) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    # The 6s open rows (room 4 each); the 4s fill them, the row that reached room 4 last first.
    assert _rows([6, 6, 4, 4, 4], 10) == [[0, 3], [1, 2], [4]]
    assert _rows([], 5) == []
