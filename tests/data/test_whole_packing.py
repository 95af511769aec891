"""Whole-dialogue offline packing (``pack_dataset``'s default): the dialogues are the reference.

Every document of every packed row (read from its ``cumulative_len``, as training reads it)
must be one whole dialogue of the input, token for token and label for label, each dialogue
exactly once; no row over ``max_length``; as many rows as best-fit decreasing needs;
deterministic for a seed. Longer documents (pretraining-style) are split into ``max_length``
pieces, and only those.
"""

from collections import Counter

import numpy as np
import pytest
from datasets import Dataset

from xtuner_rope.data.pack_plans import cut_dialogues, cut_plan, whole_plan
from xtuner_rope.data.packed_dataset import pack_dataset
from xtuner_rope.ops.packing import plan_packs


def _dialogues(lengths, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        ids = rng.integers(1, 500, n)
        labels = np.where(np.arange(n) < rng.integers(0, n + 1), -100, ids)
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return Dataset.from_list(rows)


def _documents(packed: Dataset) -> list[tuple[tuple, tuple]]:
    """``(ids, labels)`` of every packed document, cut at each row's ``cumulative_len``."""
    docs = []
    for ids, labels, bounds, pos in zip(
        packed["input_ids"], packed["labels"], packed["cumulative_len"], packed["position_ids"]
    ):
        assert bounds[0] == 0 and bounds[-1] == len(ids) == len(labels) == len(pos)
        for a, b in zip(bounds[:-1], bounds[1:]):
            assert pos[a:b] == list(range(b - a))  # positions restart at 0 per document
            docs.append((tuple(ids[a:b]), tuple(labels[a:b])))
    return docs


def _as_counter(dataset: Dataset) -> Counter:
    return Counter(
        (tuple(i), tuple(lab)) for i, lab in zip(dataset["input_ids"], dataset["labels"])
    )


@pytest.mark.parametrize(
    "n, max_length, seed",
    [(1, 7, 0), (37, 90, 1), (999, 128, 2), (2345, 97, 4), (3001, 4096, 5), (300, 89, 6)],
)
def test_every_dialogue_whole_once_and_rows_as_few_as_bfd(n, max_length, seed):
    lengths = np.random.default_rng(seed).integers(1, min(89, max_length) + 1, n)
    data = _dialogues(lengths, seed)
    packed = pack_dataset(data, max_length, True, False, 1)
    assert packed.column_names == ["input_ids", "labels", "cumulative_len", "position_ids"]
    assert Counter(_documents(packed)) == _as_counter(data)  # whole, exactly once, nothing lost
    row_lengths = [len(r) for r in packed["input_ids"]]
    assert max(row_lengths) <= max_length
    assert len(packed) == len(plan_packs(lengths, max_length))
    assert len(packed) >= -(-lengths.sum() // max_length)  # the bound no packing beats


def test_without_varlen_the_columns_are_xtuners_and_the_rows_the_same():
    data = _dialogues(np.random.default_rng(3).integers(1, 60, 500), 3)
    plain = pack_dataset(data, 128, False, False, 1)
    varlen = pack_dataset(data, 128, True, False, 1)
    assert plain.column_names == ["input_ids", "labels"]
    assert plain["input_ids"] == varlen["input_ids"] and plain["labels"] == varlen["labels"]


def test_deterministic_for_a_seed_and_the_shuffle_changes_the_rows():
    data = _dialogues(np.random.default_rng(4).integers(1, 60, 800), 4)

    def packed(seed: int) -> list:
        np.random.seed(seed)  # XTuner's shuffle draws from numpy's global generator
        return pack_dataset(data, 100, True, True, 1)["input_ids"]

    assert packed(7) == packed(7)
    assert packed(7) != packed(8)
    assert Counter(map(tuple, packed(8))) != Counter(map(tuple, packed(7)))  # other rows
    np.random.seed(7)  # without the shuffle the seed plays no part
    unshuffled = pack_dataset(data, 100, True, False, 1)["input_ids"]
    np.random.seed(8)
    assert pack_dataset(data, 100, True, False, 1)["input_ids"] == unshuffled


def test_rows_come_in_the_stream_order_of_their_first_dialogue():
    lengths = np.random.default_rng(5).integers(1, 50, 400)
    starts, sizes, row_pieces = whole_plan(lengths, 64)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    first_docs = np.searchsorted(doc_starts, starts[row_pieces[:-1]])
    assert (np.diff(first_docs) > 0).all()
    for a, b in zip(row_pieces[:-1], row_pieces[1:]):
        assert sizes[a:b].sum() <= 64 and (np.diff(starts[a:b]) > 0).all()


def test_documents_longer_than_a_row_are_split_into_max_length_pieces():
    """Pretraining-style data: every token supervised, documents up to 3.5 rows long."""
    rng = np.random.default_rng(6)
    lengths = [230, 64, 5, 129, 64 * 3, 17]
    rows = [rng.integers(1, 500, n).tolist() for n in lengths]
    data = Dataset.from_list([{"input_ids": r, "labels": r} for r in rows])
    packed = pack_dataset(data, 64, True, False, 1)
    docs = Counter(_documents(packed))
    expected = Counter()
    for r in rows:
        for k in range(0, len(r), 64):  # pieces of max_length, the last one shorter
            expected[(tuple(r[k : k + 64]), tuple(r[k : k + 64]))] += 1
    assert docs == expected
    assert max(map(len, packed["input_ids"])) <= 64


def test_cut_dialogues_counts_the_dialogues_a_row_edge_falls_inside():
    lengths = np.array([3, 5, 2, 6])  # stream edges at 3, 8, 10, 16
    assert cut_dialogues(lengths, np.array([0, 4, 8, 12, 16])) == 2  # edges 4 and 12
    assert cut_dialogues(lengths, np.array([0, 8, 16])) == 0
    assert cut_dialogues(lengths, cut_plan(lengths, 4)) == 2  # XTuner's cut: the same edges
    assert cut_dialogues(np.array([10]), cut_plan(np.array([10]), 4)) == 1  # twice, one dialogue
    assert cut_dialogues(np.zeros(0, dtype=np.int64), np.array([0])) == 0


def test_an_empty_dialogue_and_a_bad_max_length_are_refused():
    with pytest.raises(
        ValueError, match=r"dialogue 1 of the tokenized dataset has no tokens \(expected >= 1\)"
    ):
        whole_plan(np.array([3, 0, 2]), 8)
    with pytest.raises(ValueError, match=r"max_length must be a positive integer, got True"):
        whole_plan(np.array([3]), True)
    with pytest.raises(ValueError, match=r"max_length must be a positive integer, got -2"):
        pack_dataset(_dialogues([3]), -2, True, False, 1)
