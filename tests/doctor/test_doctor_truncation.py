"""The doctor and the start-up on XTuner's cut at ``max_length``, on a stock SFT config.

Stock ``internlm2_chat_1_8b_full_alpaca_e3`` with the one edit, ``max_length`` lowered below
some dialogues. The reference is live: XTuner's own unpacked ``process_hf_dataset`` of the same
config at that ``max_length`` (what it trains) and at an unlimited one (every dialogue whole).
"""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import stock_configs as sc
from logged import mmengine_records
from mmengine.config import Config
from xtuner.registry import BUILDER
from xtuner_unpatched import xtuner_unpatched

from xtuner_rope.config import startup
from xtuner_rope.doctor.diagnose import diagnose
from xtuner_rope.doctor.report import format_summary

FULL = "internlm2_chat_1_8b_full_alpaca_e3"
MAX_LENGTH = 96


@pytest.fixture(scope="module")
def alpaca(tmp_path_factory):
    """``(packed, unpacked)`` config paths and XTuner's figures of the cut (live)."""
    sc.ensure_tiny_model()
    tmp = tmp_path_factory.mktemp("alpaca")
    data = sc.write_alpaca_data(tmp / "alpaca", n=400)
    text = sc.enable_plugin(sc.localize(sc.copy_stock(FULL, tmp), data))
    text = sc.sub_once(text, r"^max_length = 512$", f"max_length = {MAX_LENGTH}")
    text = sc.sub_once(text, r"^warmup_ratio = 0.03$", "warmup_ratio = 0.1")
    packed, unpacked = tmp / "packed.py", tmp / "unpacked.py"
    packed.write_text(text)
    unpacked.write_text(
        sc.sub_once(text, r"^pack_to_max_length = True$", "pack_to_max_length = False")
    )
    return packed, unpacked, _xtuner_cut(unpacked)


def _xtuner_cut(path) -> dict:
    """What XTuner's own unpacked dataset loses at max_length, from two builds of it."""
    built = {}
    for max_length in (MAX_LENGTH, 10**9):
        cfg = Config.fromfile(str(path))
        cfg.train_dataloader.dataset.max_length = max_length
        with xtuner_unpatched():
            built[max_length] = BUILDER.build(cfg.train_dataloader.dataset)
    return _lost(built[MAX_LENGTH], built[10**9], MAX_LENGTH)


def _lost(cut, whole, max_length: int) -> dict:
    """What XTuner's dataset built at ``max_length`` (``cut``) lacks of the one built uncut."""
    return {
        "max_length": max_length,
        "dialogues": len(whole),
        "truncated": sum(len(ids) > max_length for ids in whole["input_ids"]),
        "dropped": len(whole) - len(cut),
        "tokens": sum(map(len, whole["input_ids"])) - sum(map(len, cut["input_ids"])),
        "labels": sum(x != -100 for r in whole["labels"] for x in r)
        - sum(x != -100 for r in cut["labels"] for x in r),
        "longest": max(map(len, whole["input_ids"])),
    }


def _start_up(path):
    """The train dataset built as ``xtuner train`` builds it after the start-up's fixes, and
    the lines it logs to MMEngine's current logger."""
    cfg = Config.fromfile(str(path))
    for finding in startup.inspect_config(cfg):
        if finding.fix is not None:
            finding.fix()
    with mmengine_records() as records:
        built = BUILDER.build(cfg.train_dataloader.dataset)
    return built, [r.getMessage() for r in records]


def _check(report: dict, live: dict) -> None:
    figures = report["truncation"]
    assert figures["truncated"] == live["truncated"] > 0
    assert figures["dialogues"] == live["dialogues"]
    assert figures["dropped"] == live["dropped"]
    assert figures["tokens"]["lost"] == live["tokens"] > 0
    assert figures["labels"]["lost"] == live["labels"] > 0
    assert figures["keep_all"] == live["longest"]
    assert report["samples"]["truncated"]["count"] == live["truncated"]
    summary = format_summary(report)
    assert "lost 0" not in summary and "OK:" not in summary
    assert summary.splitlines()[-1].startswith(
        f"TRUNCATED: {live['truncated']} of {live['dialogues']} dialogues lose their ends at "
        f"max_length={live['max_length']}"
    ), report["problems"]
    (warning,) = [w for w in report["warnings"] if "encode_fn truncates" in w]
    assert f"-> set max_length = {live['longest']} (every dialogue whole)" in warning


def test_packed_offline_the_doctor_and_the_start_up_count_xtuners_cut(alpaca):
    packed, _, live = alpaca
    report, _ = diagnose(str(packed), progress=False)
    assert report["exit_code"] == 0, report["problems"]
    _check(report, live)
    assert report["packing"]["tokens"]["lost"] == 0  # packing itself keeps every token
    _, lines = _start_up(packed)  # the start-up's line: the doctor's warning's sentence
    (line,) = [x for x in lines if x.startswith("xtuner-rope: packed")]
    (warning,) = [w for w in report["warnings"] if "encode_fn truncates" in w]
    assert "nothing dropped by packing" in line and warning.splitlines()[0] in line


def test_with_seed_none_the_doctor_names_the_seed_its_shuffle_used(alpaca):
    """The stock ``randomness = dict(seed=None)``: the figures are those of the seed named."""
    packed, _, _ = alpaca
    report, order = diagnose(str(packed), progress=False, batches=2)
    seed = report["packing"]["shuffle_seed"]
    assert seed["drawn"] and isinstance(seed["used"], int)
    assert (
        f"randomness.seed is None: the figures that depend on the shuffle before packing "
        f"(rows, pieces, unsupervised_seen) used seed {seed['used']}; training draws another"
    ) in format_summary(report)
    again, same = diagnose(str(packed), {"randomness.seed": seed["used"]}, 2, False)
    assert again["packing"]["shuffle_seed"] == {"used": seed["used"], "drawn": False}
    assert same == order  # the dialogues in the same shuffled order: the same rows
    assert "randomness.seed is None" not in format_summary(again)


def test_unpacked_the_doctor_and_the_start_up_count_xtuners_cut(alpaca):
    _, unpacked, live = alpaca
    report, _ = diagnose(str(unpacked), progress=False, batches=2)
    assert report["packing"] is None
    _check(report, live)
    built, lines = _start_up(unpacked)  # no start-up fix routes it: the tokenize step logs
    assert len(built) == live["dialogues"] - live["dropped"]
    (line,) = [x for x in lines if "process_hf_dataset tokenized" in x]
    (warning,) = [w for w in report["warnings"] if "encode_fn truncates" in w]
    assert warning.splitlines()[0] in line and "none truncated" not in line


INTERN_REPO_LENGTH = 60  # 4 of the 6 dialogues are longer (42 to 94 tokens)


def _logged(call):
    """``call()``'s result and the lines it logs to MMEngine's current logger."""
    with mmengine_records() as records:
        result = call()
    return result, [r.getMessage() for r in records]


def _xtuner_process(loader: dict, max_length: int):
    """What ``load_intern_repo_untokenized_dataset`` builds of its one file: XTuner's ``process``
    with the loader's arguments, in one process (the loader maps with up to 32)."""
    from datasets import Dataset
    from xtuner.dataset.huggingface import process
    from xtuner.dataset.map_fns import openai_map_fn

    (file,) = Path(loader.folder).glob("*.json")
    rows = [{"messages": json.loads(line)} for line in file.read_text().splitlines()]
    with xtuner_unpatched():
        return process(
            Dataset.from_list(rows),
            tokenizer=loader.tokenizer,
            max_length=max_length,
            dataset_map_fn=openai_map_fn,
            template_map_fn=loader.template_map_fn,
            remove_unused_columns=True,
            pack_to_max_length=False,
            map_num_proc=1,
        )


def test_intern_repo_untokenized_the_doctor_and_the_start_up_count_xtuners_cut(tmp_path):
    """Stock ``internlm2_7b_w_untokenized_dataset`` with the one edit, ``max_length`` below some
    dialogues: against XTuner's own tokenize step of its loader at that ``max_length`` and
    uncut. 6 dialogues: the loader maps its file with up to 32 processes, one per row."""
    sc.ensure_tiny_model()
    path = sc.intern_repo_config(tmp_path, n=6)
    text = sc.sub_once(
        path.read_text(), r"^max_length = 512$", f"max_length = {INTERN_REPO_LENGTH}"
    )
    path.write_text(sc.sub_once(text, r"^warm_up_ratio = 0.025$", "warm_up_ratio = 0.2"))
    loader = Config.fromfile(str(path)).train_dataloader.dataset.dataset_cfg
    cut = _xtuner_process(loader, INTERN_REPO_LENGTH)
    live = _lost(cut, _xtuner_process(loader, 10**9), INTERN_REPO_LENGTH)
    # the doctor builds through the start-up's build_whole_packed_dataset, which logs its line
    (report, _), lines = _logged(lambda: diagnose(str(path), progress=False, batches=2))
    assert report["exit_code"] == 0, report["problems"]
    _check(report, live)
    kept = sum(map(len, cut["input_ids"]))
    assert report["packing"]["tokens"] == {"before": kept, "after": kept, "lost": 0}
    (line,) = [x for x in lines if "load_intern_repo_untokenized_dataset tokenized" in x]
    (warning,) = [w for w in report["warnings"] if "encode_fn truncates" in w]
    assert warning.splitlines()[0] in line
    (packed,) = [x for x in lines if x.startswith("xtuner-rope: packed")]
    assert packed.startswith(f"xtuner-rope: packed {len(cut)} dialogues ({kept} tokens)")
    assert "every dialogue whole in one row, nothing dropped by packing." in packed


PRETRAIN = "qwen1_5_0_5b_full_custom_pretrain_e1"


def _documents(folder):
    """80 pretraining documents of 1 to 39 sample replies (43 to ~900 tokens at 512)."""
    rng = np.random.default_rng(0)
    texts = [" ".join(r[0] for _, _, r in sc._turns(int(k))) for k in rng.integers(1, 40, 80)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.json").write_text(json.dumps([{"text": t} for t in texts]))
    return folder


@pytest.fixture(scope="module")
def pretrain(tmp_path_factory):
    """Stock ``qwen1_5_0_5b_full_custom_pretrain_e1`` with the one edit (max_length 512), as it
    is and with ``offline_packing = "cut"``, and XTuner's documents uncut (live)."""
    from tools.zoo.localize import enable_plugin, localize
    from xtuner_rope.demo.resources import tiny_checkpoint

    qwen2 = sc.TINY_MODEL.with_name("tiny-qwen2")
    tiny_checkpoint(str(qwen2), data_path=str(sc.SAMPLE_DATA), family="qwen2")
    tmp = tmp_path_factory.mktemp("pretrain")
    stock = sc.copy_stock(PRETRAIN, tmp).read_text()
    text = enable_plugin(localize(stock, qwen2, _documents(tmp)))
    whole, cut = tmp / "whole.py", tmp / "cut.py"
    whole.write_text(text)
    cut.write_text(text + '\noffline_packing = "cut"\n')
    cfg = Config.fromfile(str(whole))
    cfg.train_dataloader.dataset.update(max_length=10**9, pack_to_max_length=False)
    with xtuner_unpatched():
        documents = BUILDER.build(cfg.train_dataloader.dataset)["input_ids"]
    return whole, cut, documents


def test_pretraining_documents_are_split_and_the_doctor_and_start_up_agree(pretrain):
    whole, _, documents = pretrain
    max_length = Config.fromfile(str(whole)).max_length
    long = sum(len(d) > max_length for d in documents)
    report, _ = diagnose(str(whole), progress=False, batches=2)
    figures, packing = report["truncation"], report["packing"]
    assert figures["truncated"] == 0 and figures["split"] == long > 10
    assert figures["pretraining"] and packing["split_long"] == long
    tokens = sum(map(len, documents))
    assert packing["tokens"] == {"before": tokens, "after": tokens, "lost": 0}
    summary = format_summary(report)
    assert "dialogues" not in summary.split("collate")[0]  # the words follow the data
    assert summary.splitlines()[-1].startswith("OK:"), report["problems"] + report["warnings"]
    built, lines = _start_up(whole)
    pieces = Counter(
        tuple(d[i : i + max_length]) for d in documents for i in range(0, len(d), max_length)
    )
    segments = Counter(
        tuple(row[a:b])
        for row, bounds in zip(built["input_ids"], built["cumulative_len"])
        for a, b in zip(bounds[:-1], bounds[1:])
    )
    assert segments == pieces  # every token of the corpus once, long documents as pieces
    (line,) = [x for x in lines if x.startswith("xtuner-rope: packed")]
    assert f"packed {len(documents)} documents ({tokens} tokens" in line
    assert f"({long} documents longer than a row split into max_length pieces" in line
    assert f"into {packing['rows']} rows" in line and "nothing dropped;" in line


def test_the_cut_opt_out_of_pretraining_truncates_and_ends_cut(pretrain):
    _, cut, documents = pretrain
    report, _ = diagnose(str(cut), progress=False, batches=2)
    figures, packing = report["truncation"], report["packing"]
    max_length = figures["max_length"]
    assert figures["truncated"] == sum(len(d) > max_length for d in documents) > 0
    lost = sum(max(len(d) - max_length, 0) for d in documents)
    assert figures["tokens"]["lost"] == lost and packing["tokens"]["lost"] == 0
    assert (
        format_summary(report)
        .splitlines()[-1]
        .startswith(
            f"CUT: {packing['cut_dialogues']} of {len(documents)} documents are trained as pieces "
            f"and {figures['truncated']} of {len(documents)} lose their ends at "
            f"max_length={max_length}, as this config asks"
        )
    )
    assert not any("without its prompt" in w for w in report["warnings"])
    _, lines = _start_up(cut)
    (line,) = [x for x in lines if x.startswith("xtuner-rope: packed")]
    (warning,) = [w for w in report["warnings"] if "encode_fn truncates" in w]
    assert warning.splitlines()[0] in line


def _llava_text(config: Path, max_length: int):
    """XTuner's own tokenize step of ``LLaVADataset``'s text, unpatched."""
    import llava_configs as lc

    with xtuner_unpatched():
        return lc.llava_text(config, max_length)


def test_llava_the_doctor_counts_xtuners_cut_of_the_text(tmp_path):
    """Stock LLaVA finetune config with the one edit, ``max_length`` below half the samples'
    text: the doctor's figures equal what XTuner's own text build loses at that
    ``max_length`` against the same build uncut."""
    import llava_configs as lc

    from xtuner_rope.demo.llava_data import write_llava_data
    from xtuner_rope.demo.tiny_clip import save_tiny_clip

    sc.ensure_tiny_model()
    llm = sc.tiny_with_remote_code(tmp_path / "tiny-internlm2-remote")
    data = write_llava_data(tmp_path / "data", n_images=3, n_text=3)  # XTuner maps 6 rows
    stock = sc.copy_stock(lc.FINETUNE, tmp_path)  # with up to 32 processes, one per row
    config = tmp_path / "llava.py"
    clip = save_tiny_clip(tmp_path / "tiny-clip")
    text = lc.localize_llava(stock, llm, clip, data, batch_size=1)  # warm-up: >= 1 iteration
    config.write_text(lc.enable_plugin_llava(text))
    whole = _llava_text(config, 10**9)
    max_length = sorted(map(len, whole["input_ids"]))[len(whole) // 2]
    live = _lost(_llava_text(config, max_length), whole, max_length)
    options = {"train_dataloader.dataset.max_length": max_length}
    report, _ = diagnose(str(config), options, batches=2, progress=False)
    _check(report, live)
