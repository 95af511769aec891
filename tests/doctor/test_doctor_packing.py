"""The doctor's packing figures against an independent recomputation and the training's count.

The packed rows come from the real pack steps (xtuner-rope's lossless one, XTuner's own);
``unsupervised_seen`` is checked against ``batch_stats`` on rows collated by XTuner's
``default_collate_fn``, which is how training counts it.
"""

import numpy as np
import pytest
from datasets import Dataset
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.huggingface import pack_dataset as xtuner_pack_dataset

from xtuner_rope.batch.stats import batch_stats
from xtuner_rope.data.packed_dataset import pack_dataset
from xtuner_rope.doctor.packing import packing_figures


def _dialogues(n: int, seed: int) -> Dataset:
    """Dialogues whose labels start late (prompt -100) so that many cut heads have none."""
    rng = np.random.default_rng(seed)
    rows = []
    for length in rng.integers(2, 60, n):
        ids = rng.integers(1, 300, length)
        labels = np.where(np.arange(length) < rng.integers(1, length + 1), -100, ids)
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return Dataset.from_list(rows)


def _recount(dialogues: Dataset, packed: Dataset) -> dict:
    """Row by row, dialogue by dialogue, in plain Python."""
    edges, pos = set(), 0
    for row in packed["input_ids"]:
        pos += len(row)
        edges.add(pos)
    cut, start = 0, 0
    for ids in dialogues["input_ids"]:
        cut += any(start < e < start + len(ids) for e in edges)
        start += len(ids)
    unsupervised = 0
    for labels, bounds in zip(packed["labels"], packed["cumulative_len"]):
        for a, b in zip(bounds[:-1], bounds[1:]):
            unsupervised += all(x == -100 for x in labels[a + 1 : b])
    return {"cut_dialogues": cut, "unsupervised_seen": unsupervised}


def _training_count(packed: Dataset) -> int:
    """``unsupervised_seen`` after one epoch, one row per batch, as the training hook sums it."""
    return sum(
        batch_stats(
            default_collate_fn([packed[i]], use_varlen_attn=True)["data"]
        ).unsupervised_documents
        for i in range(len(packed))
    )


@pytest.mark.parametrize("n, max_length, seed", [(300, 64, 0), (1200, 97, 1), (50, 1024, 2)])
def test_cut_figures_match_a_recount_and_the_training_count(n, max_length, seed):
    """``offline_packing = "cut"``: XTuner's cut of the stream, leftover kept."""
    dialogues = _dialogues(n, seed)
    packed = pack_dataset(dialogues, max_length, True, False, 1, whole=False)
    figures = packing_figures(dialogues, packed, max_length)
    assert figures["xtuner_cut"] == {
        "rows": len(packed),
        "cut_dialogues": _recount(dialogues, packed)["cut_dialogues"],
    }
    tokens = sum(map(len, dialogues["input_ids"]))
    labels = sum(x != -100 for row in dialogues["labels"] for x in row)
    assert figures["tokens"] == {"before": tokens, "after": tokens, "lost": 0}
    assert figures["labels"] == {"before": labels, "after": labels, "lost": 0}
    assert figures["rows"] == len(packed) and figures["dialogues"] == n
    recount = _recount(dialogues, packed)
    assert figures["cut_dialogues"] == recount["cut_dialogues"]
    assert figures["pieces"] == 2 * recount["cut_dialogues"]  # dialogues <= max_length here
    assert figures["unsupervised_seen"] == recount["unsupervised_seen"] == _training_count(packed)
    assert figures["unsupervised_pieces"] <= figures["unsupervised_seen"]
    if n >= 300:  # many cuts: some heads hold only prompt labels
        assert figures["unsupervised_pieces"] > 0


def test_xtuners_lossy_packing_counts_what_it_drops():
    dialogues = _dialogues(600, 3)
    packed = xtuner_pack_dataset(dialogues, 128, True, False, 4)  # 4 map workers
    figures = packing_figures(dialogues, packed, 128)
    kept = sum(map(len, packed["input_ids"]))
    assert 0 < figures["tokens"]["lost"] == sum(map(len, dialogues["input_ids"])) - kept
    assert figures["labels"]["lost"] > 0
    assert figures["cut_dialogues"] is None and figures["unsupervised_seen"] is None


@pytest.mark.parametrize("n, max_length, seed", [(300, 64, 0), (1200, 97, 1), (50, 1024, 2)])
def test_whole_dialogue_figures_count_no_cut_and_what_xtuner_would_cut(n, max_length, seed):
    dialogues = _dialogues(n, seed)
    packed = pack_dataset(dialogues, max_length, True, False, 1)
    figures = packing_figures(dialogues, packed, max_length)
    cut = pack_dataset(dialogues, max_length, True, False, 1, whole=False)
    assert figures["cut_dialogues"] == 0 and figures["pieces"] == 0
    assert figures["unsupervised_pieces"] == 0
    assert figures["unsupervised_seen"] == _training_count(packed)
    assert figures["rows"] == len(packed)
    assert figures["xtuner_cut"] == {
        "rows": len(cut),
        "cut_dialogues": _recount(dialogues, cut)["cut_dialogues"],
    }
    tokens = sum(map(len, dialogues["input_ids"]))
    assert figures["fill"] == round(tokens / (len(packed) * max_length), 4)
    assert figures["sft"] is True
    if n >= 300:  # short dialogues, many per row: XTuner would cut some, we cut none
        assert figures["xtuner_cut"]["cut_dialogues"] > 0


def test_a_packed_document_that_is_not_a_whole_dialogue_counts_as_a_piece():
    """Rows out of stream order with one dialogue split in two: found by content."""
    dialogues = Dataset.from_list(
        [{"input_ids": ids, "labels": ids} for ids in ([1, 2, 3], [4, 5], [6, 7, 8, 9])]
    )
    packed = Dataset.from_list(
        [
            {"input_ids": [6, 7, 1, 2, 3], "labels": [6, 7, 1, 2, 3], "cumulative_len": [0, 2, 5]},
            {"input_ids": [4, 5, 8, 9], "labels": [4, 5, 8, 9], "cumulative_len": [0, 2, 4]},
        ]
    )
    figures = packing_figures(dialogues, packed, 5)
    assert figures["cut_dialogues"] == 1 and figures["pieces"] == 2
    assert figures["sft"] is False
