"""Per-sample checks and the simulated collate plan of the doctor, against live references."""

import numpy as np
import pytest
import torch
from sample_kinds import SAMPLE_KINDS
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.utils import Packer

from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.doctor.stats import (
    _batch_shape,
    document_starts,
    length_percentiles,
    plan_summary,
    scan_samples,
    simulate_collate,
    supervised_count,
)
from xtuner_rope.ops.packing import padded_length, plan_packs


def _doc(n: int, first: int, supervised_from: int) -> tuple[list[int], list[int]]:
    ids = list(range(first, first + n))
    return ids, [-100 if col < supervised_from else t for col, t in enumerate(ids)]


def _reference_supervised(labels: list[int], starts: list[int]) -> int:
    """A plain per-document loop: every label but each document's first one."""
    ends = starts[1:] + [len(labels)]
    return sum(sum(1 for lab in labels[a + 1 : b] if lab != -100) for a, b in zip(starts, ends))


def test_plain_item_has_one_document_and_its_first_label_never_counts():
    item = {"input_ids": [5, 6, 7], "labels": [5, -100, 7]}
    assert document_starts(item) == [0]
    assert supervised_count(item) == 1
    assert supervised_count({"input_ids": [5, 6], "labels": [5, -100]}) == 0
    assert document_starts({"input_ids": [], "labels": []}) == []


@pytest.mark.parametrize("keep", ["cumulative_len", "position_ids", "both"])
def test_xtuner_packed_rows_follow_the_packers_boundaries(keep):
    # Documents of 3, 4 and 5 tokens in rows of 8: [0, 3, 7 | 8) and a continuation [0, 4).
    docs = [_doc(3, 10, 1), _doc(4, 20, 2), _doc(5, 30, 0)]
    packer = Packer(8, use_varlen_attn=True)
    out = packer({"input_ids": [d[0] for d in docs], "labels": [d[1] for d in docs]})
    row = {"input_ids": out["input_ids"][0], "labels": out["labels"][0]}
    if keep in ("cumulative_len", "both"):
        row["cumulative_len"] = torch.tensor(out["cumulative_len"][0])
    if keep in ("position_ids", "both"):
        row["position_ids"] = out["position_ids"][0]
    assert document_starts(row) == [0, 3, 7]
    assert supervised_count(row) == _reference_supervised(row["labels"], [0, 3, 7]) == 2 + 2
    # XTuner's last row carries the rest of the third document as a document of its own.
    tail = packer({"input_ids": [], "labels": []})
    rest = {"input_ids": tail["input_ids"][0], "labels": tail["labels"][0]}
    rest[keep if keep != "both" else "cumulative_len"] = tail[
        keep if keep != "both" else "cumulative_len"
    ][0]
    assert len(rest["input_ids"]) == 4 and document_starts(rest) == [0]
    assert supervised_count(rest) == 3  # the continuation's first label is lost to the cut


def test_scan_finds_each_kind_at_its_index():
    items = SAMPLE_KINDS[:6]
    scan = scan_samples(items, collate_max_length=5, truncation_length=5, progress=False)
    found = {k: (v.count, v.first_indices) for k, v in scan.issues.items()}
    assert found == {
        "empty": (1, [1]),
        "unsupervised": (1, [2]),
        "over_long": (1, [4]),
        "truncated": (1, [5]),
        "length_mismatch": (1, [3]),
    }
    assert scan.lengths == [len(i["input_ids"]) for i in items]
    assert scan.supervised == [_reference_supervised(i["labels"], [0]) for i in items]


def test_scan_lists_the_first_ten_indices_and_counts_all():
    items = [{"input_ids": [1], "labels": [1]}] * 25
    scan = scan_samples(items, collate_max_length=None, truncation_length=None, progress=False)
    assert scan.issues["unsupervised"].count == 25
    assert scan.issues["unsupervised"].first_indices == list(range(10))


def test_percentiles_match_numpy():
    lengths = [3, 17, 5, 90, 41, 41, 8]
    got = length_percentiles(lengths)
    assert got == {f"p{q}": float(np.percentile(lengths, q)) for q in (0, 50, 90, 99, 100)}
    assert length_percentiles([])["p50"] is None


def _items(lengths):
    return [
        {"input_ids": list(range(1, n + 1)), "labels": [-100] + list(range(2, n + 1))}
        for n in lengths
    ]


def test_rope_collate_plan_matches_plan_packs_and_padding_to_the_longest():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(2, 40, size=37)]
    items = _items(lengths)
    scan = scan_samples(items, collate_max_length=64, truncation_length=None, progress=False)

    def collate(batch):
        return rope_collate_fn(
            batch,
            pack=True,
            max_length=64,
            pad_to_multiple_of=8,
        )

    plan = simulate_collate(items, collate, 8, 200, scan, progress=False)
    rows, config_slots, padded_slots = [], 0, 0
    for start in range(0, len(lengths), 8):
        batch = lengths[start : start + 8]
        packs = plan_packs(batch, 64)
        s = padded_length(max(sum(batch[i] for i in p) for p in packs), pad_to_multiple_of=8)
        rows.append(len(packs))
        config_slots += len(packs) * s
        padded = default_collate_fn(items[start : start + 8])["data"]["input_ids"]
        padded_slots += padded.numel()
    assert plan.batches == 5 and plan.rows == rows
    assert (plan.config_slots, plan.padded_slots) == (config_slots, padded_slots)
    summary = plan_summary(plan)
    assert summary["real_tokens"] == sum(lengths)
    assert summary["ideal_speedup"] == pytest.approx(padded_slots / config_slots)
    assert summary["rows_per_step"] == {"mean": np.mean(rows), "min": min(rows), "max": max(rows)}


def test_simulation_stops_after_max_batches_and_records_refused_and_unsupervised_batches():
    items = _items([4, 4, 9, 4]) + [{"input_ids": [1, 2], "labels": [1, -100]}] * 2
    scan = scan_samples(items, collate_max_length=8, truncation_length=None, progress=False)

    def collate(batch):
        return rope_collate_fn(
            batch,
            pack=True,
            max_length=8,
            drop_unsupervised=True,
        )

    plan = simulate_collate(items, collate, 2, 3, scan, progress=False)
    assert plan.batches == 3
    assert [e["batch"] for e in plan.errors] == [1, 2]  # over-long sample; nothing supervised
    assert "max_length=8" in plan.errors[0]["error"]
    assert (plan.unsupervised_batches.count, plan.unsupervised_batches.first_indices) == (1, [2])
    assert plan.real_tokens == 8 and plan.rows == [1]
    assert simulate_collate(items, collate, 2, 1, scan, progress=False).batches == 1


def test_a_collate_output_without_input_ids_is_named():
    with pytest.raises(TypeError, match=r"expected a batch with a \[b, s\] input_ids tensor"):
        _batch_shape({"data": {"tokens": torch.zeros(2, 3)}})
