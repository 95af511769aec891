"""Tests for xtuner_rope.ops.packing: compared against plain per-document Python loops."""

from itertools import accumulate

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from xtuner_rope.ops.packing import (
    cumulative_from_lengths,
    cumulative_from_position_ids,
    flat_cumulative,
    lengths_from_cumulative,
    padded_length,
    plan_packs,
    position_ids_from_cumulative,
    position_ids_from_starts,
    segment_starts_from_cumulative,
)

PROPERTY = settings(deadline=None)  # example counts: the hypothesis profiles in conftest.py
lengths_st = st.lists(st.integers(1, 20), min_size=1, max_size=12)


def _reference_positions(lengths):
    """Per-document loop: each document counts 0, 1, ..., len - 1."""
    return [p for n in lengths for p in range(n)]


@PROPERTY
@given(lengths_st)
def test_cumulative_and_positions_match_per_document_loop(lengths):
    cu = cumulative_from_lengths(lengths)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, *accumulate(lengths)]
    assert lengths_from_cumulative(cu).tolist() == lengths
    positions = position_ids_from_cumulative(cu)
    assert positions.dtype == torch.long
    assert positions.tolist() == _reference_positions(lengths)
    # Round trip: boundaries are where positions restart.
    assert torch.equal(cumulative_from_position_ids(positions), cu)


@PROPERTY
@given(st.lists(lengths_st, min_size=1, max_size=5), st.integers(0, 7))
def test_batched_starts_match_per_row(rows, extra):
    totals = [sum(r) for r in rows]
    s = max(totals) + extra
    # Pad each row with a segment of its own, as the collate function does.
    cus = [cumulative_from_lengths(r + ([s - t] if s > t else [])) for r, t in zip(rows, totals)]
    starts = segment_starts_from_cumulative(cus, s)
    assert starts.shape == (len(rows), s)
    positions = position_ids_from_starts(starts)
    for r, cu in enumerate(cus):
        assert starts[r].nonzero().reshape(-1).tolist() == cu[:-1].tolist()
        assert torch.equal(positions[r], position_ids_from_cumulative(cu))


def test_position_ids_from_starts_treats_column_0_as_start():
    starts = torch.tensor([[False, False, True, False]])
    assert position_ids_from_starts(starts).tolist() == [[0, 1, 0, 1]]


def test_cumulative_from_position_ids_cut_document():
    # XTuner's Packer restarts at 0 where it cuts a document: column 0 is always a start.
    assert cumulative_from_position_ids([3, 4, 0, 1, 2, 0]).tolist() == [0, 2, 5, 6]
    assert cumulative_from_position_ids(torch.tensor([0])).tolist() == [0, 1]


def test_cumulative_from_lengths_rejects_empty_document():
    with pytest.raises(ValueError, match=r"lengths\[1\]: expected a segment length >= 1, got 0"):
        cumulative_from_lengths([3, 0, 2])


def _best_fit_decreasing_loads(lengths, max_length):
    """Reference: textbook best-fit decreasing (a linear scan of the rows), returning the loads."""
    loads = []
    for length in sorted(lengths, reverse=True):
        fits = [r for r, load in enumerate(loads) if load + length <= max_length]
        if fits:
            loads[max(fits, key=lambda r: loads[r])] += length
        else:
            loads.append(length)
    return loads


@PROPERTY
@given(st.lists(st.integers(1, 16), min_size=1, max_size=20), st.integers(16, 40))
@example([4, 4, 4, 6, 7], 16)  # greedy levelling (7+4 | 6+4+4) is worse than BFD (7+6 | 4+4+4)
def test_plan_packs_properties(lengths, max_length):
    rows = plan_packs(lengths, max_length)
    flat = [i for row in rows for i in row]
    assert sorted(flat) == list(range(len(lengths)))  # every item exactly once
    loads = [sum(lengths[i] for i in row) for row in rows]
    assert all(load <= max_length for load in loads)
    assert len(rows) <= len(lengths)
    assert all(row == sorted(row) for row in rows)
    # As few rows as best-fit decreasing needs, and never a longer longest row than BFD's.
    bfd = _best_fit_decreasing_loads(lengths, max_length)
    assert len(rows) == len(bfd)
    assert max(loads, default=0) <= max(bfd, default=0)
    assert plan_packs(lengths, max_length) == rows  # deterministic


@pytest.mark.parametrize("n, max_length, seed", [(3000, 97, 0), (2000, 2048, 1), (500, 1, 2)])
def test_plan_packs_rows_hold_the_textbook_bfd_loads_before_levelling(n, max_length, seed):
    import numpy as np

    lengths = np.random.default_rng(seed).integers(1, max_length + 1, n).tolist()
    rows = plan_packs(lengths, max_length)
    assert sorted(i for row in rows for i in row) == list(range(n))
    loads = [sum(lengths[i] for i in row) for row in rows]
    bfd = _best_fit_decreasing_loads(lengths, max_length)
    assert len(rows) == len(bfd) and max(loads) <= max_length
    assert max(loads) <= max(bfd)


def test_plan_packs_best_fit_decreasing_example():
    # BFD needs 3 rows (7+3, 5+4, 2: the batch would be padded to 10); levelled over 3 rows,
    # longest first into the shortest row: 7 | 5+2 | 4+3, padded to 7.
    assert plan_packs([7, 3, 5, 4, 2], 10) == [[0], [2, 4], [1, 3]]
    # Levelling would overflow a row (two rows for 6+4, 5+5: levelled 6+5 > 10): BFD kept.
    assert plan_packs([6, 5, 5, 4], 10) == [[0, 3], [1, 2]]
    # Levelling fits but its longest row (7+4+... = 14) beats BFD's 13: BFD kept.
    assert plan_packs([4, 4, 4, 6, 7], 16) == [[3, 4], [0, 1, 2]]
    assert plan_packs([1], 1) == [[0]]
    assert plan_packs([], 4) == []


@pytest.mark.parametrize(
    "lengths, max_length, match",
    [
        ([1, 2], 0, r"max_length: expected >= 1, got 0"),
        ([3, 0], 4, r"lengths\[1\]: expected 1..max_length=4 tokens, got 0"),
        ([5], 4, r"lengths\[0\]: expected 1..max_length=4 tokens, got 5; .*truncate"),
    ],
)
def test_plan_packs_errors(lengths, max_length, match):
    with pytest.raises(ValueError, match=match):
        plan_packs(lengths, max_length)


@pytest.mark.parametrize(
    "longest, multiple, min_length, expected",
    [
        (5, None, None, 5),
        (5, 8, None, 8),
        (8, 8, None, 8),
        (5, None, 7, 7),
        (5, 4, 7, 8),
        (9, None, 3, 9),
        (1, 3, 0, 3),
    ],
)
def test_padded_length(longest, multiple, min_length, expected):
    assert padded_length(longest, pad_to_multiple_of=multiple, min_length=min_length) == expected


@PROPERTY
@given(st.lists(lengths_st, min_size=1, max_size=4))
def test_flat_cumulative_offsets_each_row_by_its_start(rows_lengths):
    """Reference: walk the flattened [b * s] tokens row by row (rows padded to the longest)."""
    s = max(sum(lengths) for lengths in rows_lengths)
    cus = [
        cumulative_from_lengths(lengths + ([s - sum(lengths)] if sum(lengths) < s else []))
        for lengths in rows_lengths
    ]
    expected = []
    for r, cu in enumerate(cus):
        expected += [r * s + int(c) for c in cu[:-1]]
    expected.append(len(cus) * s)
    flat = flat_cumulative(cus, s)
    assert flat.dtype == torch.int32 and flat.tolist() == expected


def test_lay_out_rows_puts_each_sample_in_its_own_segment():
    from xtuner_rope.ops.packing import lay_out_rows

    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7, 3]
    samples = [(torch.randint(1, 50, (n,), generator=g),) * 2 for n in lengths]
    plan = [[2, 1], [0], [3]]
    out = lay_out_rows(samples, plan, pad_index=0)
    assert out["input_ids"].shape == (3, 8) and out["max_seqlen"] == 7
    for r, row in enumerate(plan):
        col = 0
        for i in row:
            ids, _ = samples[i]
            n = ids.numel()
            assert torch.equal(out["input_ids"][r, col : col + n], ids)
            assert out["labels"][r, col] == -100  # never predicted from the sample before
            assert torch.equal(out["labels"][r, col + 1 : col + n], ids[1:])
            assert torch.equal(out["position_ids"][r, col : col + n], torch.arange(n))
            col += n
        assert (
            bool(out["attention_mask"][r, :col].all()) and not out["attention_mask"][r, col:].any()
        )
        assert bool((out["input_ids"][r, col:] == 0).all())
        assert bool((out["labels"][r, col:] == -100).all())
        want = [0] + [sum(lengths[i] for i in row[: k + 1]) for k in range(len(row))]
        want += [8] if col < 8 else []
        assert out["cumulative_len"][r].tolist() == want
