"""Issue 38's proof inside a real ``xtuner train``: the rows the model receives, one epoch of the
stock alpaca config with the one edit (600 dialogues, ``max_length`` 512), hold every dialogue
of XTuner's own unpacked dataset whole, token for token, each exactly once. Issue 49's for
pretraining text: one epoch of the stock ``qwen1_5_0_5b_full_custom_pretrain_e1`` trains every
token of XTuner's own uncut documents exactly once, long documents as ``max_length`` pieces; and
one epoch of the stock tokenized intern-repo ``internlm2_7b_w_tokenized_dataset`` trains every
token of its ``.bin`` documents exactly once, long documents as ``packed_length`` pieces, as the
doctor and the start-up say."""

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import stock_configs as sc
import torch
from mmengine.config import Config
from xtuner.registry import BUILDER
from xtuner_unpatched import xtuner_unpatched

FULL = "internlm2_chat_1_8b_full_alpaca_e3"
HOOK_IMPORT = "from record_batches_hook import RecordBatchesHook\n"

SUPPORT = Path(__file__).resolve().parents[1] / "support"

pytestmark = pytest.mark.slow


def _recording(text: str) -> str:
    """A config's text with ``RecordBatchesHook`` first in ``custom_hooks`` (its import first
    in the file: not every stock config imports from ``xtuner.utils``)."""
    text = sc.sub_once(text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=RecordBatchesHook),")
    return HOOK_IMPORT + text


def _config(tmp_path: Path) -> Path:
    copy = sc.copy_stock(FULL, tmp_path)
    data = sc.write_alpaca_data(tmp_path / "alpaca", n=600)
    path = tmp_path / "alpaca.py"
    path.write_text(_recording(sc.enable_plugin(sc.localize(copy, data))))
    return path


def _train_one_epoch(config: Path, tmp_path: Path, monkeypatch, *overrides) -> tuple[list, str]:
    """One epoch of ``config`` through the real ``xtuner train`` (``--cfg-options`` plus
    ``overrides``): the recorded batches, the log."""
    sc.ensure_tiny_model()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SUPPORT), str(sc.REPO)]))
    work = tmp_path / "run"
    proc = sc.xtuner_train(
        config,
        work,
        "train_cfg.max_epochs=1",
        "accumulative_counts=1",
        "randomness.seed=0",
        *overrides,
    )
    out = proc.stdout + proc.stderr
    assert (work / "batches.pt").is_file(), out[-3000:]
    return torch.load(work / "batches.pt", weights_only=False), out


def assert_every_dialogue_whole_once(batches: list, unpacked, max_length: int = 512) -> float:
    """Each document of the received rows is one dialogue of ``unpacked`` (ids equal, labels
    equal but the document's first), each dialogue exactly once; returns the fill."""
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
            slots += max_length
            for a, b in zip(bounds[:-1], bounds[1:]):
                seen[(tuple(ids[a:b].tolist()), (-100, *labels[a + 1 : b].tolist()))] += 1
    assert len(unpacked) == 600 and sum(dialogues.values()) == 600
    assert seen == dialogues  # each dialogue whole, ids and labels (but its first), once
    tokens = sum(map(len, unpacked["input_ids"]))
    print(f"{len(batches)} iterations, {sum(seen.values())} documents, fill {tokens / slots:.1%}")
    return tokens / slots


def test_one_epoch_trains_every_dialogue_whole_and_once(tmp_path, monkeypatch):
    config = _config(tmp_path)
    batches, out = _train_one_epoch(config, tmp_path, monkeypatch)
    assert "every dialogue whole in one row" in out
    cfg = Config.fromfile(str(config))
    cfg.train_dataloader.dataset.pack_to_max_length = False
    unpacked = BUILDER.build(cfg.train_dataloader.dataset)
    assert assert_every_dialogue_whole_once(batches, unpacked) >= 0.95


def test_one_intern_repo_epoch_trains_every_dialogue_whole_and_once(tmp_path, monkeypatch):
    """Stock ``internlm2_7b_w_untokenized_dataset`` (intern-repo loader and packer), the same
    600 dialogues as untokenized message lines: XTuner's ``build_packed_dataset`` cuts 11% of
    them; with the one edit each is trained whole, once."""
    sc.ensure_tiny_model()
    config = sc.intern_repo_config(tmp_path)
    config.write_text(_recording(config.read_text()))
    batches, out = _train_one_epoch(config, tmp_path, monkeypatch)
    assert "every dialogue whole in one row" in out  # the untokenized loader's: dialogues
    loader = Config.fromfile(str(config)).train_dataloader.dataset.dataset_cfg
    (unpacked,) = BUILDER.build(loader)  # XTuner's own dialogues of the one file, unpacked
    assert assert_every_dialogue_whole_once(batches, unpacked) >= 0.95


PRETRAIN = "qwen1_5_0_5b_full_custom_pretrain_e1"


def _pretraining_texts() -> list[str]:
    """60 pretraining texts: the sample replies of 1 to 39 dialogues joined (~40 to ~900
    tokens, a third longer than a 512-token row)."""
    rng = np.random.default_rng(1)
    return [" ".join(r[0] for _, _, r in sc._turns(int(k))) for k in rng.integers(1, 40, 60)]


def assert_every_token_once(batches: list, documents: list, row: int, supervised_from: int):
    """The received rows, cut at their document boundaries, are exactly the ``row``-token
    pieces of ``documents`` (each once), every label from the ``supervised_from``-th token of a
    piece on equal to its id; returns how many pieces."""
    pieces = Counter(tuple(d[i : i + row]) for d in documents for i in range(0, len(d), row))
    trained = Counter()
    for batch in batches:
        for ids, labels, bounds in zip(
            batch["input_ids"], batch["labels"], batch["cumulative_len"]
        ):
            bounds = bounds.tolist()
            for a, b in zip(bounds[:-1], bounds[1:]):
                trained[tuple(ids[a:b].tolist())] += 1
                first = a + supervised_from
                assert (labels[first:b] == ids[first:b]).all()  # every token supervised
    assert trained == pieces  # every token of the corpus once, long documents as pieces
    return sum(trained.values())


def _pretraining_documents(folder: Path) -> Path:
    """60 pretraining documents (``{"text": ...}``) of 1 to 39 sample replies: ~40 to ~900
    tokens, a third of them longer than a 512-token row."""
    texts = _pretraining_texts()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.json").write_text(json.dumps([{"text": t} for t in texts]))
    return folder


def test_one_pretraining_epoch_trains_every_token_once(tmp_path, monkeypatch):
    """The rows the model received, cut at their document boundaries, are exactly the
    ``max_length`` pieces of XTuner's own documents built uncut (``max_length`` 10**9, no
    packing, without the plugin): every token of the corpus trained once, none cut off."""
    from tools.zoo.localize import enable_plugin, localize
    from xtuner_rope.demo.resources import tiny_checkpoint

    qwen2 = sc.TINY_MODEL.with_name("tiny-qwen2")
    tiny_checkpoint(str(qwen2), data_path=str(sc.SAMPLE_DATA), family="qwen2")
    stock = sc.copy_stock(PRETRAIN, tmp_path).read_text()
    text = enable_plugin(localize(stock, qwen2, _pretraining_documents(tmp_path / "docs")))
    config = tmp_path / "pretrain.py"
    config.write_text(_recording(text))
    max_length = Config.fromfile(str(config)).max_length
    # the stock 3% warm-up rounds to 0 iterations on this small epoch (the zoo's refusal)
    warmup = ("param_scheduler.0.end=0.1", "param_scheduler.1.begin=0.1")
    batches, out = _train_one_epoch(config, tmp_path, monkeypatch, *warmup)
    cfg = Config.fromfile(str(config))
    cfg.train_dataloader.dataset.update(max_length=10**9, pack_to_max_length=False)
    with xtuner_unpatched():
        documents = BUILDER.build(cfg.train_dataloader.dataset)["input_ids"]
    long = sum(len(d) > max_length for d in documents)
    assert long >= 10, long
    # a document's first label is never predicted from its document
    trained = assert_every_token_once(batches, documents, max_length, supervised_from=1)
    tokens = sum(map(len, documents))
    assert f"packed {len(documents)} documents ({tokens} tokens" in out
    print(
        f"{len(batches)} iterations, {trained} pieces of {len(documents)} "
        f"documents ({long} split), {tokens} tokens each trained once"
    )


TOKENIZED = "internlm2_7b_w_tokenized_dataset"


def _tokenized_documents(folder: Path) -> list[list[int]]:
    """60 pretraining documents (the sample replies of 1 to 39 dialogues, tiny InternLM2 ids,
    BOS first) in XTuner's tokenized intern-repo files: ``folder/documents.bin`` (one
    ``{"tokens": [...]}`` a line, every id positive: every token supervised) and its
    ``.bin.meta`` index; ~40 to ~900 tokens, a third longer than a 512-token row."""
    from transformers import AutoTokenizer

    from tools.zoo.intern_repo import signed_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(sc.TINY_MODEL))
    texts = _pretraining_texts()
    documents = [tokenizer.encode(t) for t in texts]
    folder.mkdir(parents=True, exist_ok=True)
    meta, offset, lines = [], 0, []
    for ids in documents:
        lines.append(json.dumps({"tokens": signed_tokens(ids, ids)}) + "\n")  # no id 0
        meta.append((offset, len(ids)))
        offset += len(lines[-1].encode("utf-8"))
    (folder / "documents.bin").write_text("".join(lines), encoding="utf-8")
    with open(folder / "documents.bin.meta", "wb") as f:  # np.save to a handle: no .npy
        np.save(f, np.array(meta, dtype=np.int64))
    return documents


def test_one_tokenized_intern_repo_epoch_trains_every_token_once(tmp_path, monkeypatch):
    """Stock ``internlm2_7b_w_tokenized_dataset`` with the one edit on ``.bin`` pretraining
    documents: the rows the model received, cut at their document boundaries, are exactly the
    ``packed_length`` pieces of the documents written (every token once, all supervised), and
    the doctor's and the start-up's figures (documents, split, pieces, tokens, rows) are the
    epoch's."""
    from tools.zoo.localize import enable_plugin, localize
    from xtuner_rope.doctor.diagnose import diagnose
    from xtuner_rope.doctor.report import format_summary

    sc.ensure_tiny_model()
    documents = _tokenized_documents(tmp_path / "docs")
    stock = sc.copy_stock(TOKENIZED, tmp_path).read_text()
    config = tmp_path / "tokenized.py"
    config.write_text(_recording(enable_plugin(localize(stock, sc.TINY_MODEL, tmp_path / "docs"))))
    packed_length = Config.fromfile(str(config)).train_dataloader.dataset.packed_length
    batches, out = _train_one_epoch(config, tmp_path, monkeypatch)
    long = [d for d in documents if len(d) > packed_length]
    assert len(long) >= 10, len(long)
    trained = assert_every_token_once(batches, documents, packed_length, supervised_from=0)
    tokens, split = sum(map(len, documents)), sum(-(-len(d) // packed_length) for d in long)
    assert (
        f"packed {len(documents)} documents ({tokens} tokens) into {len(batches)} rows of "
        f"packed_length={packed_length}"
    ) in out
    assert (
        f"({len(long)} documents longer than a row split into {split} packed_length pieces)" in out
    )
    report, _ = diagnose(str(config), batches=2, progress=False)
    packing = report["packing"]
    assert (packing["dialogues"], packing["rows"]) == (len(documents), len(batches))
    assert (packing["split_long"], packing["split_pieces"]) == (len(long), split)
    assert packing["tokens"] == {"before": tokens, "after": tokens, "lost": 0}
    assert packing["cut_dialogues"] == 0 and report["exit_code"] == 0
    summary = format_summary(report)
    assert (
        f"{len(long)} documents longer than max_length={packed_length} split into {split} "
        "max_length pieces"
    ) in summary
    assert summary.splitlines()[-1].startswith("OK"), summary
    print(
        f"{len(batches)} iterations, {trained} pieces of {len(documents)} "
        f"documents ({len(long)} split into {split}), {tokens} tokens each trained once"
    )
