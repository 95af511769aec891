"""``xtuner-rope doctor`` on held-out entries: the held-out set's size and its overlap with training.

XTuner's stock full fine-tune config with the one edit, on 40 alpaca dialogues, given a held-out
set through MMEngine's entries (a separate file holding 6 new dialogues and 3 training ones)
and through the ``heldout = dict(fraction=...)`` shortcut. Every figure is checked against
a count made here from XTuner's own unpacked dataset and the data files; the unit tests of the
figures themselves (packed rows, online packing, the hook's log line) are in
tests/evaluation/test_heldout_counts.py.
"""

import json
from pathlib import Path

import heldout as ho
import pytest
import stock_configs as sc
from mmengine.config import Config
from xtuner.registry import BUILDER

from tools.zoo.localize import one_map_process
from xtuner_rope.doctor.diagnose import diagnose
from xtuner_rope.doctor.report import format_summary

FULL = "internlm2_chat_1_8b_full_alpaca_e3"
TRAIN_ROWS = 40


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("doctor-heldout")
    alpaca = sc.write_alpaca_data(root / "alpaca", n=TRAIN_ROWS)
    held = ho.write_heldout_data(root / "held", n=6)
    rows = json.loads((held / "train.json").read_text())
    train_rows = json.loads((alpaca / "train.json").read_text())
    (held / "train.json").write_text(json.dumps(rows + train_rows[5:8]))  # 3 in training too
    text = sc.enable_plugin(sc.localize(sc.copy_stock(FULL, root), alpaca))
    # one map process (localize's; XTuner's default is 32): the shortcut's held-out dict is a
    # copy of this one
    return {"root": root, "text": text, "held": held, "train_rows": train_rows}


def _write(stock: dict, name: str, text: str) -> Path:
    path = stock["root"] / name
    path.write_text(text, encoding="utf-8")
    return path


def _started(config: Path) -> Config:
    from xtuner_rope.config.as_xtuner_train import start

    cfg = Config.fromfile(str(config))
    start(cfg, look_only=True)
    return cfg


def _built_heldout(config: Path):
    """The held-out dataset as the run builds it (after the start-up: packed whole)."""
    return BUILDER.build(_started(config).val_dataloader.dataset)


def _plain_counts(config: Path) -> tuple[int, int]:
    """``(dialogues, supervised tokens)`` of the started config's held-out set, unpacked
    (XTuner's ``process_hf_dataset``, one dialogue a sample; labels after the first)."""
    dataset_cfg = _started(config).val_dataloader.dataset
    dataset_cfg.type = "xtuner.dataset.process_hf_dataset"
    dataset_cfg.pack_to_max_length = False
    dataset_cfg.use_varlen_attn = False
    dataset = BUILDER.build(dataset_cfg)
    return len(dataset), sum(sum(x != -100 for x in s["labels"][1:]) for s in dataset)


def _pairs(rows: list[dict]) -> list[tuple]:
    return [(r["instruction"], r["input"], r["output"]) for r in rows]


def test_doctor_reports_a_separate_heldout_file(stock):
    text = ho.with_heldout(stock["text"], stock["held"])
    text = one_map_process(text)  # the held-out dataset's maps too
    config = _write(stock, "entries.py", text)
    report, _ = diagnose(str(config), progress=False)
    figures = report["heldout"]
    dialogues, supervised = _plain_counts(config)
    held_rows = json.loads((stock["held"] / "train.json").read_text())
    train = set(_pairs(stock["train_rows"]))
    assert figures["dialogues"] == dialogues == len(held_rows) == 9
    assert figures["supervised_tokens"] == supervised > 0
    overlap = sum(p in train for p in _pairs(held_rows))
    assert figures["in_training"] == overlap >= 3  # the 3 copied, and any repeat of the data
    # packed whole (heldout_process_hf_dataset) into rows of the config's max_length
    assert figures["max_length"] == Config.fromfile(str(config)).max_length == 512
    assert figures["rows"] == len(_built_heldout(config)) >= 1
    assert figures["fill"] == pytest.approx(figures["tokens"] / (figures["rows"] * 512))
    text = format_summary(report)
    assert (
        f"held-out     9 dialogues, {supervised} supervised tokens, {figures['rows']} rows packed "
        f"to max_length=512 (fill {figures['fill']:.1%}); in the training data too: {overlap} "
        "dialogues"
    ) in text
    warning = f"{overlap} of 9 held-out dialogues are in the training data too"
    assert any(warning in w for w in report["warnings"])
    assert not [p for p in report["problems"] if "held" in p], report["problems"]


def test_doctor_reports_the_shortcut_fraction(stock):
    line = "heldout = dict(fraction=0.25)\n"
    config = _write(
        stock, "shortcut.py", sc.sub_once(stock["text"], r"^(max_length = \d+\n)", r"\g<1>" + line)
    )
    report, _ = diagnose(str(config), progress=False)
    figures = report["heldout"]
    dialogues, supervised = _plain_counts(config)
    cut = TRAIN_ROWS * 3 // 4
    kept, held = _pairs(stock["train_rows"][:cut]), _pairs(stock["train_rows"][cut:])
    assert figures["dialogues"] == dialogues == len(held) == 10
    assert figures["supervised_tokens"] == supervised
    # disjoint rows; a dialogue the file repeats is in both (counted, not hidden)
    assert figures["in_training"] == sum(p in set(kept) for p in held)
    assert report["dataset"]["dialogues"] == cut  # training keeps the rest


def test_doctor_without_heldout_entries_reports_none(stock):
    report, _ = diagnose(str(_write(stock, "plain.py", stock["text"])), progress=False)
    assert report["heldout"] is None
    assert "held-out" not in format_summary(report)
