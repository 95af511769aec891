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


def test_a_document_longer_than_a_row_is_split_not_counted_as_cut():
    """Whole-dialogue packing splits a document longer than a row into max_length pieces by
    design: the doctor reports it apart (``split_long``) and counts no dialogue cut."""
    rng = np.random.default_rng(3)
    rows = [rng.integers(1, 300, n).tolist() for n in (30, 12, 75, 20, 9)]  # 75 > 32
    dialogues = Dataset.from_list([{"input_ids": ids, "labels": ids} for ids in rows])
    packed = pack_dataset(dialogues, 32, True, False, 1)
    figures = packing_figures(dialogues, packed, 32)
    assert figures["split_long"] == 1
    assert figures["cut_dialogues"] == 0 and figures["pieces"] == 0
    assert figures["tokens"]["lost"] == 0
    cut = packing_figures(dialogues, pack_dataset(dialogues, 32, True, False, 1, whole=False), 32)
    assert cut["split_long"] == 1 and cut["cut_dialogues"] >= 1  # XTuner's cut counts it


def _files(seed: int) -> list:
    """Two intern-repo files of dialogues (each file is packed on its own)."""
    return [_dialogues(250, seed), _dialogues(120, seed + 1)]


def _intern_repo_recount(files: list, packed_length: int, seed: int) -> dict:
    """XTuner's intern-repo cut, file by file in plain Python: a dialogue is cut when a row
    edge (every ``packed_length`` tokens of the shuffled stream, the last one where the dropped
    partial row begins) falls strictly inside it."""
    cut = lost = rows = 0
    for ds in files:
        order = np.arange(len(ds))
        np.random.RandomState(seed).shuffle(order)
        lengths = [len(ds[int(i)]["input_ids"]) for i in order]
        total = sum(lengths)
        rows += total // packed_length
        lost += total % packed_length
        edges = range(packed_length, total, packed_length)
        start = 0
        for n in lengths:
            cut += any(start < e < start + n for e in edges)
            start += n
    return {"cut_dialogues": cut, "lost": lost, "rows": rows}


@pytest.mark.parametrize("packed_length, seed", [(64, 0), (97, 1)])
def test_intern_repo_figures_of_xtuners_cut_and_of_whole_documents(packed_length, seed):
    """``build_packed_dataset`` (XTuner's cut, ``offline_packing = "cut"``) and
    ``build_whole_packed_dataset`` over two files: the figures against a recount."""
    from xtuner.dataset.intern_repo import build_packed_dataset

    from xtuner_rope.data.intern_repo_packing import build_whole_packed_dataset
    from xtuner_rope.doctor.packing import intern_repo_figures

    files = _files(seed)
    want = _intern_repo_recount(files, packed_length, 1024)
    tokens = sum(len(ids) for ds in files for ids in ds["input_ids"])
    xtuner = build_packed_dataset(files, packed_length=packed_length, seed=1024)
    lengths, cut = intern_repo_figures(xtuner, packed_length)
    assert sorted(lengths) == sorted(len(ids) for ds in files for ids in ds["input_ids"])
    assert cut["dialogues"] == 370 and cut["rows"] == len(xtuner) == want["rows"]
    assert cut["tokens"] == {"before": tokens, "after": tokens - want["lost"], "lost": want["lost"]}
    assert cut["cut_dialogues"] == want["cut_dialogues"] > 0
    assert cut["xtuner_cut"] == {"rows": want["rows"], "cut_dialogues": want["cut_dialogues"]}
    # Every cut dialogue is two pieces but the one whose tail the dropped partial row takes.
    assert cut["pieces"] == 2 * cut["cut_dialogues"] - 2
    whole = build_whole_packed_dataset(files, packed_length=packed_length, seed=1024)
    _, figures = intern_repo_figures(whole, packed_length)
    assert figures["cut_dialogues"] == 0 == figures["pieces"]
    assert figures["tokens"] == {"before": tokens, "after": tokens, "lost": 0}
    assert figures["rows"] == len(whole) and figures["xtuner_cut"] == cut["xtuner_cut"]
    assert figures["fill"] == round(tokens / (len(whole) * packed_length), 4) >= 0.95
    assert figures["unsupervised_seen"] == _training_count(_rows(whole))


def _rows(concat) -> Dataset:
    rows = [concat[i] for i in range(len(concat))]
    return Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})


@pytest.fixture(scope="module")
def intern_repo(tmp_path_factory):
    """The doctor's reports on stock ``internlm2_7b_w_untokenized_dataset`` with the one edit
    (600 dialogues, ``max_length`` 512), as it is and with ``offline_packing = "cut"``."""
    import stock_configs as sc

    from xtuner_rope.doctor.diagnose import diagnose

    sc.ensure_tiny_model()
    whole = sc.intern_repo_config(tmp_path_factory.mktemp("intern_repo"))
    cut = whole.with_name("intern_repo_cut.py")
    cut.write_text(whole.read_text() + '\noffline_packing = "cut"\n')
    return [diagnose(str(path), batches=2, progress=False)[0] for path in (whole, cut)]


@pytest.mark.slow
def test_the_doctor_on_the_stock_intern_repo_config(intern_repo):
    """Whole documents: 0 cut, the fill, the epoch before (XTuner's cut) and after; "OK".
    What it says XTuner's cut would do is what the cut opt-out's real rows do."""
    from xtuner_rope.doctor.report import format_summary

    report, cut = intern_repo[0]["packing"], intern_repo[1]["packing"]
    tokens = report["tokens"]["before"]
    assert intern_repo[0]["exit_code"] == 0, intern_repo[0]["problems"]
    assert report["packer"] == "intern_repo" and report["max_length"] == 512
    assert report["dialogues"] == 600 == intern_repo[0]["dataset"]["documents"]
    assert report["cut_dialogues"] == 0 == report["pieces"]
    assert report["tokens"] == {"before": tokens, "after": tokens, "lost": 0}
    assert report["rows"] == intern_repo[0]["dataset"]["samples"] and report["fill"] >= 0.95
    assert cut["tokens"]["before"] == tokens and cut["dialogues"] == 600  # the same dialogues
    assert report["xtuner_cut"] == {"rows": cut["rows"], "cut_dialogues": cut["cut_dialogues"]}
    assert cut["rows"] == tokens // 512 and cut["cut_dialogues"] > 0
    summary = format_summary(intern_repo[0])
    assert (
        f"epoch: {report['rows']} rows, {report['rows']} iterations of batch size 1; XTuner's "
        f"cut of the same stream: {cut['rows']} rows, {cut['rows']} iterations, "
        f"{cut['cut_dialogues']} dialogues cut" in summary
    )
    assert summary.splitlines()[-1].startswith("OK: nothing")


@pytest.mark.slow
def test_the_doctor_counts_what_the_intern_repo_cut_opt_out_cuts(intern_repo):
    from xtuner_rope.doctor.report import format_summary

    report = intern_repo[1]
    packing = report["packing"]
    assert report["exit_code"] == 0, report["problems"]
    assert packing["cut_dialogues"] == packing["xtuner_cut"]["cut_dialogues"] > 0
    assert packing["rows"] == packing["xtuner_cut"]["rows"] == report["dataset"]["samples"]
    lost = packing["tokens"]["lost"]
    assert 0 < lost < 512 and report["dataset"]["documents"] > 600  # pieces
    assert any(
        w.startswith(f"XTuner's offline packing drops {lost} of ") and "last partial row" in w
        for w in report["warnings"]
    )
    assert (
        format_summary(report)
        .splitlines()[-1]
        .startswith(f"CUT: {packing['cut_dialogues']} of 600 dialogues are trained as pieces")
    )
