"""Tests for xtuner_rope/ops/positions.py: position-id checks, their messages and their cache."""

import pytest
import torch
from host_sync import NoHostSync

from xtuner_rope.ops.positions import check_position_ids


def test_returns_range():
    assert check_position_ids(torch.tensor([[3, 0, 9]]), 4, 3) == (0, 9)
    assert check_position_ids(torch.tensor([[3, 0, 9]]), 1, 3, limit=10) == (0, 9)
    assert check_position_ids(torch.zeros(1, 0, dtype=torch.long), 1, 0) == (0, -1)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert check_position_ids(torch.arange(5, dtype=dtype)[None], 2, 5) == (0, 4)


@pytest.mark.parametrize(
    "pos, batch, limit, error, match",
    [
        (
            torch.arange(3.0)[None],
            2,
            None,
            TypeError,
            r"integer tensor \(torch.long\), got torch.float32",
        ),
        (
            torch.ones(1, 3, dtype=torch.bool),
            2,
            None,
            TypeError,
            r"integer tensor .* got torch.bool",
        ),
        (
            torch.arange(3),
            2,
            None,
            ValueError,
            r"2-D \[b, s\], got shape \(3,\); use .*view\(1, -1\)",
        ),
        (
            torch.arange(6).view(2, 3),
            3,
            None,
            ValueError,
            r"\(2, 3\).*batch 3.*expected \(1, 3\) or \(3, 3\)",
        ),
        (
            torch.tensor([[0, 1, 2], [0, -1, 5]]),
            2,
            None,
            ValueError,
            r"non-negative, got -1 at row 1, column 1; positions count tokens from 0",
        ),
        # The largest position is named (a real document's: padding segments are shorter).
        (
            torch.tensor([[0, 1, 2], [0, 7, 9]]),
            2,
            7,
            ValueError,
            r"holds 9 at row 1, column 2, beyond the supported range \[0, 7\) \(the test limit\); "
            r"do something",
        ),
    ],
)
def test_errors_name_value_place_and_limit(pos, batch, limit, error, match):
    with pytest.raises(error, match=match):
        check_position_ids(pos, batch, 3, limit, "the test limit", "do something")


def test_range_computed_once_per_tensor(monkeypatch):
    # Every layer of a model checks the same tensor: one aminmax (one host sync) for all.
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(1) or aminmax(t))
    pos = torch.arange(4)[None]
    for _ in range(3):
        check_position_ids(pos, 1, 4)
    assert len(calls) == 1
    check_position_ids(pos.clone(), 1, 4)  # a new tensor with equal values is checked again
    assert len(calls) == 2


def test_cache_sees_in_place_edits():
    pos = torch.arange(4)[None]
    check_position_ids(pos, 1, 4)
    pos[0, 2] = -7  # same tensor object, new version counter: checked again
    with pytest.raises(ValueError, match=r"got -7 at row 0, column 2"):
        check_position_ids(pos, 1, 4)


def test_inference_tensors_are_checked_every_time():
    with torch.inference_mode():
        pos = torch.arange(4)[None]
    assert check_position_ids(pos, 1, 4, limit=4) == (0, 3)
    with pytest.raises(ValueError, match=r"holds 4 at row 0, column 3"):
        check_position_ids(pos + 1, 1, 4, limit=4)


def test_known_range_reads_no_device_ids():
    """A range known on the host (the batch's host boundaries) is trusted for device ids: the
    meta device has no values, and ``NoHostSync`` fails at any read."""
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with NoHostSync():
        assert check_position_ids(ids, 2, 8, 16, known_range=(0, 7)) == (0, 7)
        assert check_position_ids(ids, 2, 8, known_range=(0, 99)) == (0, 99)  # unbounded
    # Out of range: the ids themselves are read, to name the culprit (meta: none to read).
    with pytest.raises(ValueError, match="meta tensor"):
        check_position_ids(ids, 2, 8, 16, known_range=(0, 16))
    # Host ids are read on the host: their own range, whatever is known.
    assert check_position_ids(torch.arange(8)[None], 1, 8, 16, known_range=(0, 3)) == (0, 7)
