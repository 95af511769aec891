"""``xtuner-rope doctor`` on the tiny recipe, on bad data, and on conflicting configs."""

import configparser
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import stock_configs as sc
from matplotlib.image import imread
from tiny_recipe import load_config
from xtuner.registry import BUILDER

from xtuner_rope.cli import main
from xtuner_rope.config import startup
from xtuner_rope.config.findings import MODEL_RESOURCE_EDIT
from xtuner_rope.doctor.diagnose import build_collate_fn, diagnose
from xtuner_rope.doctor.report import format_summary, write_outputs
from xtuner_rope.doctor.stats import supervised_count

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_internlm2_short_dialogues.py"
DATA_FILE = "train_dataloader.dataset.dataset.data_files.train"


@pytest.fixture(scope="module")
def in_repo():
    """The tiny recipe's paths (checkpoint, data) are relative to the repository root."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        yield


@pytest.fixture(scope="module")
def tiny(in_repo, tmp_path_factory):
    report, lengths = diagnose(str(TINY), progress=False)
    paths = write_outputs(report, lengths, tmp_path_factory.mktemp("doctor"))
    dataset = BUILDER.build(load_config(str(TINY)).train_dataloader.dataset)
    return report, lengths, paths, dataset


def test_tiny_recipe_is_healthy_and_counted_from_the_built_dataset(tiny):
    report, lengths, _, dataset = tiny
    with open(REPO / "data" / "short_dialogues.jsonl", encoding="utf-8") as f:
        rows = sum(1 for _ in f)
    assert report["exit_code"] == 0 and report["problems"] == []
    assert report["dataset"]["samples"] == len(dataset) == rows == 2400
    live = [len(item["input_ids"]) for item in dataset]
    assert lengths == live
    assert report["lengths"] == {
        f"p{q}": float(np.percentile(live, q)) for q in (0, 50, 90, 99, 100)
    }
    assert report["plugin"]["enabled"] and report["findings"]["conflicts"] == []
    assert all(v["count"] == 0 for v in report["samples"].values())
    collate = report["collate"]
    assert collate["batches"] == collate["batches_total"] == 150  # 2400 / 16, all under 200
    assert collate["real_tokens"] == sum(live)
    assert collate["config_share"] > collate["padded_share"]


def test_tiny_recipe_writes_json_and_a_png(tiny):
    report, lengths, paths, _ = tiny
    assert json.loads(paths["report"].read_text()) == report
    image = imread(paths["lengths"])  # fails on anything but a valid PNG
    assert image.shape == (400, 700, 4) and image.std() > 0
    text = format_summary(report)
    assert "OK: nothing that would fail" in text and "ideal speed-up" in text
    assert report["checkpoints"]["at_once"] == 2  # a save at 100 and the last, keep 1 (+1)
    assert "\ncheckpoints  " in text and " at once need " in text
    assert report["logits"]["tokens"] == 512 and report["logits"]["full_because"] is None
    assert "\nlogits       a row of 512 tokens x vocabulary " in text
    full = {**report, "checkpoints": {**report["checkpoints"], "free_bytes": 0}}
    assert format_summary(full).endswith(
        "DISK: the checkpoints the run keeps do not fit in the free space (see the warning); "
        "nothing else would fail or corrupt training (exit 0)"
    )


def test_xtuner_offline_packing_is_checked_after_the_start_up_fix(in_repo, tmp_path):
    text = TINY.read_text(encoding="utf-8")
    assert text.count("    pack_to_max_length=False,\n") == 1
    text = text.replace("    pack_to_max_length=False,\n", "    pack_to_max_length=True,\n")
    config = tmp_path / "tiny_packed.py"
    config.write_text(text, encoding="utf-8")
    report, lengths = diagnose(str(config), progress=False)
    assert [f["setting"] for f in report["findings"]["fixes"]] == [
        "train_dataloader.dataset.use_varlen_attn",
        "train_dataloader.dataset.type",
    ]
    # The lengths are the dialogues' (before packing), recomputed from XTuner's own builder.
    unpacked = BUILDER.build(load_config(str(TINY)).train_dataloader.dataset)
    live = [len(item["input_ids"]) for item in unpacked]
    assert sorted(lengths) == sorted(live) and max(lengths) < 512
    assert report["lengths"]["p50"] == float(np.percentile(live, 50))
    assert report["dataset"]["source_rows"] == 2400 == report["dataset"]["dialogues"]
    # The fixes record the boundaries and pack each dialogue whole: 2,400 documents, none cut.
    packing = report["packing"]
    assert report["dataset"]["documents"] == 2400 and packing["row_lengths"]["p100"] <= 512
    assert packing["cut_dialogues"] == 0 == packing["pieces"]
    assert packing["xtuner_cut"]["cut_dialogues"] > 0  # what XTuner's cut would have done
    assert packing["rows"] <= 1.03 * packing["xtuner_cut"]["rows"] and packing["fill"] >= 0.95
    labels = sum(x != -100 for item in unpacked for x in item["labels"])
    assert packing["tokens"] == {"before": sum(live), "after": sum(live), "lost": 0}
    assert packing["labels"] == {"before": labels, "after": labels, "lost": 0}
    # 476 rows (XTuner's cut: 475), 30 steps of 16: the stock 3% warm-up rounds to 0 steps, MMEngine would refuse
    # it ("end should be larger than begin"): the one problem, with the edit
    assert report["exit_code"] == 1 and len(report["problems"]) == 1
    assert report["problems"][0].startswith(
        "param_scheduler[0]: LinearLR, begin=0, end=0.03 "
        "epochs, convert_to_iter_based=True, becomes begin=0"
        ", end=0 iterations on this dataset (476 samples"
    )
    assert "warmup_ratio * max_epochs >= 0.0333" in report["problems"][0]
    assert text.count("\nmodel_resource = ") == 1
    config.write_text(text.replace("\nmodel_resource = ", "\n_no_model_resource = "))
    report, _ = diagnose(str(config), progress=False)
    assert report["dataset"]["documents"] == report["dataset"]["samples"]  # no boundaries
    assert report["exit_code"] == 1
    assert "unfixed: train_dataloader.dataset.use_varlen_attn" in report["problems"][0]
    lost = report["packing"]["tokens"]["lost"]  # XTuner drops its last leftover
    assert 0 < lost < 512 and report["packing"]["unsupervised_seen"] is None
    assert any(
        w.startswith(f"XTuner's offline packing drops {lost} of ") for w in report["warnings"]
    )


def test_the_cut_opt_out_is_reported_with_the_dialogues_it_cuts(in_repo, tmp_path):
    """``offline_packing = "cut"``: exit 0 (a choice), but never a silent "OK"."""
    text = TINY.read_text(encoding="utf-8")
    text = text.replace("    pack_to_max_length=False,\n", "    pack_to_max_length=True,\n")
    text = sc.sub_once(text, r"^warmup_ratio = 0.03$", "warmup_ratio = 0.1")  # >= 1 step
    text += '\noffline_packing = "cut"\n'
    config = tmp_path / "tiny_cut.py"
    config.write_text(text, encoding="utf-8")
    report, _ = diagnose(str(config), progress=False)
    packing = report["packing"]
    assert report["exit_code"] == 0, report["problems"]
    assert packing["cut_dialogues"] == packing["xtuner_cut"]["cut_dialogues"] > 0
    assert packing["rows"] == packing["xtuner_cut"]["rows"]
    cut = packing["cut_dialogues"]
    assert any(
        w.startswith(f"{cut} of 2400 dialogues are cut at row edges") for w in report["warnings"]
    )
    summary = format_summary(report)
    assert summary.splitlines()[-1].startswith(
        f"CUT: {cut} of 2400 dialogues are trained as pieces"
    )
    assert "OK: nothing" not in summary


@pytest.mark.slow
def test_doctor_counts_unsupervised_documents_as_the_training_log(in_repo, tmp_path):
    """One epoch of the tiny recipe packed offline with XTuner's cut: the log's final
    unsupervised_seen.

    Not shuffled before packing, so that the doctor's packs are the training's whatever
    consumes numpy's global RNG before the dataset is built. The first 600 of the 2,400 sample
    dialogues (a quarter of the epoch: the count is the same sum over fewer rows).
    """
    data = tmp_path / "dialogues.jsonl"
    lines = (REPO / "data" / "short_dialogues.jsonl").read_text(encoding="utf-8").splitlines()
    data.write_text("\n".join(lines[:600]) + "\n", encoding="utf-8")
    text = sc.sub_once(TINY.read_text(), r'^data_path = ".*"$', f'data_path = "{data}"')
    text = sc.sub_once(text, r"^    pack_to_max_length=False,$", "    pack_to_max_length=True,")
    text = sc.sub_once(text, r"^    shuffle_before_pack=True,$", "    shuffle_before_pack=False,")
    # XTuner's cut (the opt-out): its pieces without a supervised label are what both count;
    # whole dialogues (the default) give none here (test_xtuner_offline_packing_is_checked...).
    text += '\noffline_packing = "cut"\n'
    config = tmp_path / "tiny_packed.py"
    # ~120 rows, 8 steps of 16: a warm-up of 3% would round to 0 steps (MMEngine refuses it)
    config.write_text(sc.sub_once(text, r"^warmup_ratio = 0.03", "warmup_ratio = 0.25"))
    report, _ = diagnose(str(config), progress=False)
    proc = sc.xtuner_train(
        config, tmp_path / "run", "default_hooks.logger.interval=1", timeout=1800
    )
    out = proc.stdout + proc.stderr
    seen = re.findall(r"Iter\(train\) \[ *(\d+)/ *(\d+)\].*unsupervised_seen: ([0-9.]+)", out)
    assert seen and seen[-1][0] == seen[-1][1], out[-3000:]  # the epoch's last iteration
    assert float(seen[-1][2]) == report["packing"]["unsupervised_seen"] > 0


def test_packing_switched_on_by_an_override_is_refused_as_training_would(in_repo):
    """``xtuner train`` merges --cfg-options after the start-up: too late for its fix."""
    packed = {"train_dataloader.dataset.pack_to_max_length": True}
    report, _ = diagnose(str(TINY), packed, progress=False, batches=2)
    assert report["findings"]["fixes"] == [] and report["exit_code"] == 1
    assert report["problems"][0].startswith(
        "conflict: train_dataloader.dataset.use_varlen_attn: set after the start-up ran "
        "(--cfg-options): process_hf_dataset(pack_to_max_length=True) joins dialogues"
    )


def _dialogue(user: str, reply: str | None, loss: bool = True) -> dict:
    messages = [{"role": "user", "content": user}]
    if reply is not None:
        messages.append({"role": "assistant", "content": reply, "loss": loss})
    return {"messages": messages}


@pytest.fixture(scope="module")
def bad_dialogues(tmp_path_factory):
    """30 sample dialogues with 4 bad ones at source rows 5, 6, 10 and 11."""
    with open(REPO / "data" / "short_dialogues.jsonl", encoding="utf-8") as f:
        good = [json.loads(line) for line, _ in zip(f, range(30))]
    rows = (
        good[:5]
        + [_dialogue("Say nothing.", "")]  # 5: empty reply
        + [_dialogue("Hello?", None)]  # 6: no assistant turn
        + good[5:8]
        + [_dialogue("Tell me about it.", "I like it a lot. " * 300)]  # 10: long
        + [_dialogue("Shh.", "Not trained on.", loss=False)]  # 11: reply without loss
        + good[8:]
    )
    path = tmp_path_factory.mktemp("bad") / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_xtuner_drops_assistant_less_and_loss_free_dialogues_and_truncates_long_ones(
    in_repo, bad_dialogues
):
    report, lengths = diagnose(str(TINY), {DATA_FILE: str(bad_dialogues)}, progress=False)
    dataset = BUILDER.build(
        load_config(str(TINY), {DATA_FILE: str(bad_dialogues)}).train_dataloader.dataset
    )
    assert report["dataset"]["source_rows"] == 34
    assert report["dataset"]["samples"] == len(dataset) == 32  # rows 6 and 11 dropped
    assert report["dataset"]["dropped_by_dataset"] == 2
    assert lengths == [len(item["input_ids"]) for item in dataset]
    # Source row 10 is sample 9 after the drop, cut to max_length=512 but still supervised.
    assert report["samples"]["truncated"] == {"count": 1, "first_indices": [9]}
    assert lengths[9] == 512 and supervised_count(dataset[9]) > 0
    # The empty reply (sample 5) keeps its end-of-turn token as its only supervised label.
    assert supervised_count(dataset[5]) == sum(lab != -100 for lab in dataset[5]["labels"]) >= 1
    assert report["samples"]["unsupervised"]["count"] == 0
    # 32 samples are 2 steps of 16: the recipe's warm-up rounds to 0 steps, which MMEngine
    # refuses ("end should be larger than begin"); the data itself has no problem
    assert report["exit_code"] == 1 and len(report["problems"]) == 1
    assert report["problems"][0].startswith("param_scheduler[0]: LinearLR")
    assert (
        "2 of 34 source rows were dropped by XTuner (2 without a supervised label, 0 left "
        "without one by the truncation at max_length)"
    ) in report["warnings"]
    # The cut counted exactly: XTuner's own dataset uncut against the one it trains.
    uncut = load_config(str(TINY), {DATA_FILE: str(bad_dialogues)}).train_dataloader.dataset
    whole = BUILDER.build(dict(uncut, max_length=10**9))
    lost = sum(map(len, whole["input_ids"])) - sum(map(len, dataset["input_ids"]))
    assert report["truncation"]["tokens"]["lost"] == lost == len(whole[9]["input_ids"]) - 512
    assert report["truncation"]["keep_all"] == len(whole[9]["input_ids"])


def test_samples_over_the_collate_max_length_fail(in_repo, bad_dialogues):
    options = {DATA_FILE: str(bad_dialogues), "train_dataloader.collate_fn.max_length": 256}
    report, lengths = diagnose(str(TINY), options, progress=False)
    over = [i for i, n in enumerate(lengths) if n > 256]
    assert over == [9]
    assert report["samples"]["over_long"] == {"count": 1, "first_indices": [9]}
    assert [e["batch"] for e in report["collate"]["errors"]] == [0]  # samples 0-15
    assert "max_length=256" in report["collate"]["errors"][0]["error"]
    assert report["exit_code"] == 1
    assert any("longer than the collate max_length=256" in p for p in report["problems"])


SMALL_CONFIG = """\
from datasets import load_dataset
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.config.startup import enable_xtuner_rope

pretrained_model_name_or_path = "unused"
model_resource = dict(fn=enable_xtuner_rope)
train_dataloader = dict(
    batch_size=2,
    dataset=dict(type=load_dataset, path="json", data_files={data!r}, split="train"),
    collate_fn=dict(type=rope_collate_fn, pack=True, max_length=8),
)
"""
TOKENIZED = [
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
    {"input_ids": [1, 2, 3], "labels": [1, -100, -100]},  # 1: only the never-used first label
    {"input_ids": [4, 5], "labels": [-100, -100]},  # 2: unsupervised; batch 1 = samples 2, 3
    {
        "input_ids": [4, 5, 6, 7],
        "labels": [-100, -100, 6, -100],
        "cumulative_len": [0, 2, 4],
    },  # 3: packed, the only label is a document's first
    {"input_ids": [], "labels": []},  # 4: empty
    {"input_ids": [1, 2, 3], "labels": [-100, 2]},  # 5: length mismatch
    {"input_ids": list(range(1, 11)), "labels": list(range(1, 11))},  # 6: over max_length=8
    {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, -100, 4], "position_ids": [0, 1, 0, 1]},
]


def _small_config(tmp_path: Path, rows: list[dict]) -> Path:
    data = tmp_path / "tokenized.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = tmp_path / "small.py"
    config.write_text(SMALL_CONFIG.format(data=str(data)), encoding="utf-8")
    return config


def test_each_kind_of_bad_tokenized_sample_is_found(tmp_path):
    report, _ = diagnose(str(_small_config(tmp_path, TOKENIZED)), progress=False)
    found = {k: (v["count"], v["first_indices"]) for k, v in report["samples"].items()}
    assert found == {
        "empty": (1, [4]),
        "unsupervised": (3, [1, 2, 3]),
        "over_long": (1, [6]),
        "truncated": (0, []),
        "length_mismatch": (1, [5]),
    }
    assert report["dataset"]["documents"] == 9  # 3 and 7 hold two documents, 4 none
    assert report["collate"]["unsupervised_batches"] == {"count": 1, "first_indices": [1]}
    assert report["exit_code"] == 1
    for words in (
        "empty samples",
        "max_length=8",
        "len(labels) != len(input_ids)",
        "without any supervised label",
    ):
        assert any(words in p for p in report["problems"]), words
    assert any("without a supervised label" in w for w in report["warnings"])


GOOD = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}] * 5


def test_clean_small_config_passes_and_conflicts_fail_with_the_setting_named(tmp_path, monkeypatch):
    monkeypatch.setitem(startup._STATE, "prepared", False)
    config = str(_small_config(tmp_path, GOOD))
    report, _ = diagnose(config, progress=False)
    assert report["exit_code"] == 0 and report["problems"] == []
    assert [f["setting"] for f in report["findings"]["fixes"]] == ["custom_hooks"]
    assert not startup.is_prepared()  # the doctor looked; it started no run in this process
    report, _ = diagnose(config, {"sequence_parallel_size": 0}, progress=False)
    assert [c["setting"] for c in report["findings"]["conflicts"]] == ["sequence_parallel_size"]
    assert report["exit_code"] == 1
    assert report["problems"][0].startswith("conflict: sequence_parallel_size")


def test_plugin_not_enabled_fails_with_packed_data_and_warns_without(tmp_path):
    path = _small_config(tmp_path, GOOD)
    # The file's model_resource line removed: xtuner train runs it before any --cfg-options.
    text = path.read_text(encoding="utf-8")
    assert text.count("\nmodel_resource = ") == 1
    path.write_text(text.replace("\nmodel_resource = ", "\n_no_model_resource = "))
    config = str(path)
    report, _ = diagnose(config, progress=False)
    assert not report["plugin"]["enabled"] and report["plugin"]["edit"]
    assert report["packed"] and report["exit_code"] == 1
    assert MODEL_RESOURCE_EDIT in report["problems"][0]
    report, _ = diagnose(config, {"train_dataloader.collate_fn.pack": False}, progress=False)
    assert not report["packed"] and report["exit_code"] == 0
    assert MODEL_RESOURCE_EDIT in report["warnings"][0]


def test_unknown_collate_name_is_refused():
    with pytest.raises(ValueError, match="train_dataloader.collate_fn.type: expected a function"):
        build_collate_fn({"collate_fn": {"type": "no_such_collate_fn"}})


def test_cli_exit_codes_and_outputs(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["doctor", str(_small_config(tmp_path, GOOD)), "--out", str(out)]) == 0
    assert (out / "report.json").is_file() and (out / "lengths.png").is_file()
    steps = [line for line in capsys.readouterr().err.splitlines() if line.startswith("doctor: ")]
    assert steps[0].startswith("doctor: starting the config as xtuner train does (")
    assert any(line.startswith("doctor: checking ") for line in steps)
    bad = tmp_path / "bad"
    bad.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "xtuner_rope.cli",
            "doctor",
            str(_small_config(bad, TOKENIZED)),
            "--out",
            str(bad / "out"),
            "--batches",
            "3",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "FAIL: training would fail" in run.stdout
    assert "doctor: " not in run.stderr and "examples/s" not in run.stderr  # --quiet
    assert json.loads((bad / "out" / "report.json").read_text())["collate"]["batches"] == 3


def test_setup_cfg_declares_the_console_script():
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    scripts = [
        line
        for line in parser["options.entry_points"]["console_scripts"].splitlines()
        if line.strip()
    ]
    assert scripts == ["xtuner-rope = xtuner_rope.cli:main"]
    module, attr = scripts[0].split("=")[1].strip().split(":")
    assert getattr(importlib.import_module(module), attr) is main
