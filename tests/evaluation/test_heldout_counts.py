"""The held-out set's figures: documents of packed rows, supervised tokens, rows, fill, overlap."""

from types import SimpleNamespace

import pytest
from datasets import Dataset
from mmengine.logging import MMLogger

from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.evaluation.heldout_counts import (
    collated_rows,
    dialogue_keys,
    document_bounds,
    document_keys,
    heldout_counts,
    heldout_line,
    row_capacity,
)
from xtuner_rope.evaluation.hook import log_heldout_counts

A, B, C = [1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]
LA, LB, LC = [-100, -100, 3, 4], [-100, 6, 7], [-100, -100, -100, 11, 12]


def _packed() -> Dataset:
    """Two rows packed XTuner's way: [A B] and [C], ``cumulative_len`` and ``position_ids``."""
    return Dataset.from_dict(
        {
            "input_ids": [A + B, C],
            "labels": [LA + LB, LC],
            "cumulative_len": [[0, 4, 7], [0, 5]],
            "position_ids": [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4]],
        }
    )


@pytest.mark.parametrize("column", ["cumulative_len", "position_ids"])
def test_documents_of_a_packed_row(column):
    row = {"input_ids": A + B, column: _packed()[0][column]}
    assert document_bounds(row) == [0, 4, 7]
    assert document_bounds({"input_ids": A}) == [0, 4]


def test_figures_of_packed_rows_against_a_plain_count():
    training = dialogue_keys([B, [99, 98]])  # B is in training too
    figures = heldout_counts(_packed(), training, max_length=8)
    # each document's labels after its first that are not -100 (what TokenLossMetric scores)
    supervised = sum(sum(x != -100 for x in labels[1:]) for labels in (LA, LB, LC))
    assert figures == {
        "dialogues": 3,
        "supervised_tokens": supervised,
        "tokens": 12,
        "rows": 2,
        "max_length": 8,
        "fill": 12 / 16,
        "in_training": 1,
    }
    assert document_keys(_packed()) == dialogue_keys([A, B, C])


def test_online_packing_rows_come_from_the_collate_function():
    plain = Dataset.from_dict({"input_ids": [A, B, C], "labels": [LA, LB, LC]})
    collate = lambda items: rope_collate_fn(items, pack=True, max_length=8)  # noqa: E731
    rows = collated_rows(plain, collate, batch_size=3)
    assert rows == 2  # A + B fit one row of 8, C the next
    figures = heldout_counts(plain, set(), max_length=8, rows=rows)
    assert figures["rows"] == 2 and figures["dialogues"] == 3 and figures["fill"] == 12 / 16


def test_row_capacity_follows_who_packs():
    assert row_capacity({"max_length": 512}, {"pack": True, "max_length": 256}) == 256
    assert (
        row_capacity({"max_length": 512}, {"type": "default_collate_fn"}) == 512
    )  # XTuner's default
    assert row_capacity({"max_length": 512, "pack_to_max_length": False}, None) is None


def test_the_run_logs_the_figures_at_start(capsys):
    packed = _packed()
    loader = SimpleNamespace(dataset=packed, collate_fn=rope_collate_fn, batch_size=1)
    runner = SimpleNamespace(
        cfg={"val_dataloader": {"dataset": {"max_length": 8}}},
        val_loop=SimpleNamespace(dataloader=loader),
        train_dataloader=SimpleNamespace(dataset=Dataset.from_dict({"input_ids": [C, [7, 7]]})),
    )
    MMLogger.get_instance("test_figures")  # a fresh logger: its handler writes to this stdout
    figures = log_heldout_counts(runner)
    assert figures["in_training"] == 1 and figures["rows"] == 2
    out = capsys.readouterr().out
    assert "held-out set 3 dialogues, 6 supervised tokens, 2 rows packed to max_length=8" in out
    assert "1 of 3 held-out dialogues are in the training data too (same token ids)" in out


def test_overlap_not_counted_when_the_training_set_is_not_counted():
    """``training=None`` (an image dataset without tokenized text): the held-out figures are
    counted, the overlap is reported as not counted, never as 0."""
    figures = heldout_counts(_packed(), None, max_length=8)
    assert figures["in_training"] is None and figures["dialogues"] == 3
    assert "overlap with the training data not counted" in heldout_line(figures)
    assert "in the training data too" not in heldout_line(figures)
