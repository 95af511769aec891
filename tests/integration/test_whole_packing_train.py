"""Issue 38's proof inside a real ``xtuner train``: the rows the model receives, one epoch of the
stock alpaca config with the one edit (600 dialogues, ``max_length`` 512), hold every dialogue
of XTuner's own unpacked dataset whole, token for token, each exactly once."""

import os
from collections import Counter
from pathlib import Path

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config
from xtuner.registry import BUILDER

FULL = "internlm2_chat_1_8b_full_alpaca_e3"
HOOK_IMPORT = "from record_batches_hook import RecordBatchesHook\n"

SUPPORT = Path(__file__).resolve().parents[1] / "support"

pytestmark = pytest.mark.slow


def _config(tmp_path: Path) -> Path:
    copy = sc.copy_stock(FULL, tmp_path)
    data = sc.write_alpaca_data(tmp_path / "alpaca", n=600)
    text = sc.enable_plugin(sc.localize(copy, data))
    text = sc.sub_once(text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=RecordBatchesHook),")
    text = sc.sub_once(text, r"^(from xtuner.utils import .*\n)", r"\g<1>" + HOOK_IMPORT)
    path = tmp_path / "alpaca.py"
    path.write_text(text)
    return path


def test_one_epoch_trains_every_dialogue_whole_and_once(tmp_path, monkeypatch):
    sc.ensure_tiny_model()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SUPPORT), str(sc.REPO)]))
    config = _config(tmp_path)
    work = tmp_path / "run"
    proc = sc.xtuner_train(
        config, work, "train_cfg.max_epochs=1", "accumulative_counts=1", "randomness.seed=0"
    )
    out = proc.stdout + proc.stderr
    assert (work / "batches.pt").is_file(), out[-3000:]
    assert "every dialogue whole in one row" in out
    batches = torch.load(work / "batches.pt", weights_only=False)
    cfg = Config.fromfile(str(config))
    cfg.train_dataloader.dataset.pack_to_max_length = False
    unpacked = BUILDER.build(cfg.train_dataloader.dataset)
    dialogues = Counter(
        (tuple(ids), (-100, *labels[1:]))
        for ids, labels in zip(unpacked["input_ids"], unpacked["labels"])
    )
    seen, slots = Counter(), 0
    for batch in batches:
        for ids, labels, bounds in zip(
            batch["input_ids"], batch["labels"], batch["cumulative_len"]
        ):
            bounds = bounds.tolist()
            slots += 512
            for a, b in zip(bounds[:-1], bounds[1:]):
                seen[(tuple(ids[a:b].tolist()), (-100, *labels[a + 1 : b].tolist()))] += 1
    assert len(unpacked) == 600 and sum(dialogues.values()) == 600
    assert seen == dialogues  # each dialogue whole, ids and labels (but its first), once
    tokens = sum(map(len, unpacked["input_ids"]))
    print(f"{len(batches)} iterations, {sum(seen.values())} documents, fill {tokens / slots:.1%}")
    assert tokens / slots >= 0.95
