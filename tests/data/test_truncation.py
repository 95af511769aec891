"""XTuner's cut at ``max_length`` counted exactly (xtuner_rope.data.truncation).

The references are live: XTuner's own ``process_hf_dataset`` (unpatched) on the same data at
the same ``max_length`` (what training gets) and at an unlimited one (every dialogue whole):
the counted build must be XTuner's, row for row, and its figures the difference of the two.
Pretraining documents (``pretrain_map_fn``) packed whole: every token of the corpus in exactly
one packed document, longer documents as their ``max_length`` pieces.
"""

import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import stock_configs as sc
from datasets import load_dataset
from mmengine.logging import MMLogger
from transformers import AutoTokenizer
from xtuner.dataset import huggingface as xtuner_hf
from xtuner.dataset.huggingface import process_hf_dataset
from xtuner.dataset.map_fns import (
    alpaca_map_fn,
    oasst1_map_fn,
    pretrain_map_fn,
    template_map_fn_factory,
)
from xtuner.utils import PROMPT_TEMPLATE
from xtuner_unpatched import xtuner_unpatched

from xtuner_rope.data.packed_dataset import lossless_process_hf_dataset
from xtuner_rope.data.truncation import counting_truncation, summed_figures

UNLIMITED = 10**9


def _tokenizer(family: str = "internlm2") -> dict:
    from xtuner_rope.demo.resources import tiny_checkpoint

    path = sc.TINY_MODEL.with_name(f"tiny-{family}")
    tiny_checkpoint(str(path), data_path=str(sc.SAMPLE_DATA), family=family)
    return dict(
        type=AutoTokenizer.from_pretrained,
        pretrained_model_name_or_path=str(path),
        trust_remote_code=True,
    )


def _write_oasst1(folder: Path, n: int) -> Path:
    """The sample dialogues, every turn, in oasst1's ``### Human: ... ### Assistant:`` text."""
    rows = [
        {"text": "".join(f"### Human: {u}### Assistant: {r}" for u, r in zip(users, replies))}
        for _, users, replies in sc._turns(n)
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.json").write_text(json.dumps(rows), encoding="utf-8")
    return folder


# (data, dataset_map_fn, template, tokenizer family): stock alpaca configs (one turn), and
# llama2_7b_chat_qlora_oasst1_e3's multi-turn dialogues (a cut falls in any turn)
KINDS = {
    "alpaca": (sc.write_alpaca_data, alpaca_map_fn, PROMPT_TEMPLATE.internlm2_chat, "internlm2"),
    "oasst1": (_write_oasst1, oasst1_map_fn, PROMPT_TEMPLATE.llama2_chat, "llama"),
}


def _sft(kind: str, path: Path, max_length: int, builder=process_hf_dataset, **kwargs):
    _, map_fn, template, family = KINDS[kind]
    return builder(
        dataset=dict(type=load_dataset, path=str(path)),
        tokenizer=_tokenizer(family),
        max_length=max_length,
        dataset_map_fn=map_fn,
        template_map_fn=dict(type=template_map_fn_factory, template=template),
        map_num_proc=1,
        **{"pack_to_max_length": False, **kwargs},
    )


@pytest.fixture(scope="module", params=list(KINDS))
def sft(request, tmp_path_factory):
    """200 dialogues of a kind and XTuner's unlimited build of them (every dialogue whole)."""
    kind = request.param
    path = KINDS[kind][0](tmp_path_factory.mktemp(kind), 200)
    with xtuner_unpatched():
        return kind, path, _sft(kind, path, UNLIMITED)


def _tokens(dataset) -> int:
    return sum(map(len, dataset["input_ids"]))


def _labels(dataset) -> int:
    return sum(x != -100 for row in dataset["labels"] for x in row)


@pytest.mark.parametrize("max_length", [24, 64])  # 24: some dialogues cut to their prompt
def test_the_counted_cut_is_xtuners_and_counts_what_it_loses(sft, max_length):
    kind, path, whole = sft
    with xtuner_unpatched():
        xtuner = _sft(kind, path, max_length)
    with counting_truncation() as sink:
        counted = _sft(kind, path, max_length)
    assert xtuner_hf.tokenize_dataset.__module__ == "xtuner.dataset.huggingface"  # restored
    assert counted["input_ids"] == xtuner["input_ids"]
    assert counted["labels"] == xtuner["labels"]
    (figures,) = sink
    lengths = np.asarray([len(r) for r in whole["input_ids"]])
    assert figures["dialogues"] == len(whole)
    assert figures["truncated"] == int((lengths > max_length).sum()) > 0
    assert figures["dropped"] == len(whole) - len(xtuner)
    assert figures["dropped"] > 0 or max_length == 64
    assert figures["tokens"] == {
        "before": _tokens(whole),
        "after": _tokens(xtuner),
        "lost": _tokens(whole) - _tokens(xtuner),
    }
    assert figures["labels"] == {
        "before": _labels(whole),
        "after": _labels(xtuner),
        "lost": _labels(whole) - _labels(xtuner),
    }
    assert figures["keep_all"] == lengths.max()
    share = (lengths <= figures["keep_99"]).mean()
    assert share >= 0.99 and (lengths < figures["keep_99"]).mean() < 0.99
    assert figures["first_truncated"] and all(
        len(xtuner[i]["input_ids"]) == max_length for i in figures["first_truncated"]
    )
    assert not figures["pretraining"] and figures["split"] == 0


def test_nothing_cut_counts_nothing_and_nested_blocks_both_count(sft):
    kind, path, whole = sft
    with counting_truncation() as outer, counting_truncation() as inner:
        counted = _sft(kind, path, 4096)
    assert counted["input_ids"] == whole["input_ids"]
    assert outer == inner and len(outer) == 1
    figures = summed_figures(outer)
    assert figures["truncated"] == figures["dropped"] == figures["tokens"]["lost"] == 0
    assert figures["tokens"]["before"] == figures["tokens"]["after"] == _tokens(whole)


def test_an_unpacked_build_outside_any_block_is_xtuners_and_logs_the_count(sft):
    """``process_hf_dataset(pack_to_max_length=False)`` as a config builds it (no start-up fix
    routes it): XTuner's data row for row, and one start-up line with what the cut lost."""
    kind, path, whole = sft
    with xtuner_unpatched():
        xtuner = _sft(kind, path, 64)
    built, lines = _start_up_lines(lambda: _sft(kind, path, 64))
    assert built["input_ids"] == xtuner["input_ids"] and built["labels"] == xtuner["labels"]
    (line,) = [(level, x) for level, x in lines if "process_hf_dataset tokenized" in x]
    truncated = sum(len(r) > 64 for r in whole["input_ids"])
    assert line[0] == logging.WARNING and truncated > 0
    assert (
        f"tokenized {len(whole)} dialogues ({_tokens(whole)} tokens, {_labels(whole)} "
        f"supervised labels) at max_length=64. XTuner's encode_fn truncates {truncated} of "
        f"{len(whole)} dialogues at max_length=64"
    ) in line[1]
    assert f"{_tokens(whole) - _tokens(xtuner)} of {_tokens(whole)} tokens" in line[1]
    assert f"max_length = {max(map(len, whole['input_ids']))} keeps every dialogue" in line[1]
    _, lines = _start_up_lines(lambda: _sft(kind, path, 4096))
    (line,) = [(level, x) for level, x in lines if "process_hf_dataset tokenized" in x]
    assert line[0] == logging.INFO and line[1].endswith("at max_length=4096, none truncated.")


def _write_documents(path: Path, n: int = 60) -> Path:
    """``n`` pretraining documents of 1 to ~40 sample dialogues' text, in ``{"text": ...}``."""
    rng = np.random.default_rng(0)
    texts = [
        " ".join(r[0] for _, _, r in sc._turns(int(k)))
        for k in rng.integers(1, 40, n)  # the same first dialogues: repeated text, on purpose
    ]
    path.write_text(json.dumps([{"text": t} for t in texts]), encoding="utf-8")
    return path


def _pretrain(path: Path, max_length: int, builder=process_hf_dataset, **kwargs):
    return builder(
        dataset=dict(type=load_dataset, path="json", data_files=[str(path)]),
        tokenizer=_tokenizer(),
        max_length=max_length,
        dataset_map_fn=pretrain_map_fn,
        template_map_fn=None,
        remove_unused_columns=True,
        shuffle_before_pack=False,
        map_num_proc=1,
        **kwargs,
    )


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))


def _start_up_lines(build):
    """What the build logs to MMEngine's current logger (where the start-up's lines go)."""
    logger, lines = MMLogger.get_current_instance(), _Lines()
    logger.addHandler(lines)
    try:
        return build(), lines.lines
    finally:
        logger.removeHandler(lines)


def _segments(packed) -> list[tuple]:
    return [
        tuple(row[a:b])
        for row, bounds in zip(packed["input_ids"], packed["cumulative_len"])
        for a, b in zip(bounds[:-1], bounds[1:])
    ]


def test_pretraining_documents_are_split_every_token_once(tmp_path):
    path, max_length = _write_documents(tmp_path / "docs.json"), 128
    with xtuner_unpatched():
        whole = _pretrain(path, UNLIMITED, pack_to_max_length=False)
    pieces = Counter(
        tuple(ids[i : i + max_length])
        for ids in whole["input_ids"]
        for i in range(0, len(ids), max_length)
    )
    long = sum(len(ids) > max_length for ids in whole["input_ids"])
    assert long > 10
    packed, lines = _start_up_lines(
        lambda: _pretrain(path, max_length, lossless_process_hf_dataset, use_varlen_attn=True)
    )
    assert Counter(_segments(packed)) == pieces  # every token once, each piece a document
    assert all(len(row) <= max_length for row in packed["input_ids"])
    (level, line) = next(x for x in lines if x[1].startswith("xtuner-rope: packed"))
    assert level == logging.INFO and "nothing dropped;" in line
    assert f"packed {len(whole)} documents ({_tokens(whole)} tokens" in line
    assert f"({long} documents longer than a row split into max_length pieces" in line
    assert "truncates" not in line


def test_the_cut_opt_out_truncates_pretraining_documents_and_says_so(tmp_path):
    path, max_length = _write_documents(tmp_path / "docs.json"), 128
    with xtuner_unpatched():
        whole = _pretrain(path, UNLIMITED, pack_to_max_length=False)
        xtuner = _pretrain(path, max_length, pack_to_max_length=False)
    packed, lines = _start_up_lines(
        lambda: _pretrain(
            path,
            max_length,
            lossless_process_hf_dataset,
            use_varlen_attn=True,
            whole_dialogues=False,
        )
    )
    assert _tokens(packed) == _tokens(xtuner) < _tokens(whole)
    (level, line) = next(x for x in lines if x[1].startswith("xtuner-rope: packed"))
    truncated = sum(len(ids) > max_length for ids in whole["input_ids"])
    lost = _tokens(whole) - _tokens(xtuner)
    assert level == logging.WARNING and "nothing dropped by packing" in line
    assert (
        f"XTuner's encode_fn truncates {truncated} of {len(whole)} documents at "
        f"max_length={max_length}: {lost} of {_tokens(whole)} tokens" in line
    )
    assert f"max_length = {max(map(len, whole['input_ids']))} keeps every document" in line


def test_the_start_up_line_compares_epochs_only_when_they_differ():
    """Dialogues of exactly max_length: whole packing and XTuner's cut make the same rows."""
    from datasets import Dataset

    from xtuner_rope.data.packed_dataset import pack_dataset

    rows = [{"input_ids": [5] * 8, "labels": [-100] * 3 + [5] * 5} for _ in range(6)]
    _, lines = _start_up_lines(lambda: pack_dataset(Dataset.from_list(rows), 8, True, False, 1))
    (line,) = [m for _, m in lines if m.startswith("xtuner-rope: packed")]
    assert "XTuner's cut would make 6 rows and cut 0 dialogues: an epoch has as many rows." in line
    assert "instead of" not in line
    short = [{"input_ids": [5] * 5, "labels": [5] * 5}] * 3  # 3 rows whole, 2 cut
    _, lines = _start_up_lines(lambda: pack_dataset(Dataset.from_list(short), 8, True, False, 1))
    (line,) = [m for _, m in lines if m.startswith("xtuner-rope: packed")]
    assert "an epoch is 3 rows instead of 2 (iterations per epoch change with it)." in line


def test_the_intern_repo_line_compares_epochs_only_when_they_differ():
    from xtuner_rope.data.intern_repo_packing import _summary

    assert _summary(np.array([8] * 6), 6, 8).endswith("an epoch has as many rows.")
    assert "an epoch is 3 rows instead of 1 " in _summary(np.array([5] * 3), 3, 8)
