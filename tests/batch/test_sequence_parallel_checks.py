"""The batch check and the doctor under sequence parallel: XTuner's shard split divisibility,
rows shorter than the SP size, the padding segment, the start-up's heads refusal."""

import re
from pathlib import Path

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config
from runners import tiny_runner
from xtuner.dataset.collate_fns import default_collate_fn

from xtuner_rope.batch.sequence_parallel import (
    check_sequence_parallel_rows,
    sequence_parallel_padding,
)
from xtuner_rope.compat.devices import cpu_only, gloo_all_to_all_missing
from xtuner_rope.config import startup
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.doctor.diagnose import diagnose
from xtuner_rope.doctor.report import format_summary
from xtuner_rope.hooks import PackedBatchCheckHook
from xtuner_rope.hooks import isolation as hooks_module


def _items(lengths, vocab=256):
    g = torch.Generator().manual_seed(0)
    return [
        dict(
            input_ids=torch.randint(3, vocab, (n,), generator=g).tolist(),
            labels=torch.randint(3, vocab, (n,), generator=g).tolist(),
        )
        for n in lengths
    ]


def test_padding_to_a_multiple_of_the_size():
    assert [sequence_parallel_padding(n, 4) for n in (1, 3, 4, 5, 8, 255)] == [3, 1, 0, 3, 0, 1]


def test_xtuner_collated_rows_not_divisible_are_refused_with_the_edit():
    # XTuner's own collate (one process: no SP group, so it does not pad) of 9- and 13-token rows.
    shape = tuple(default_collate_fn(_items([9, 13]))["data"]["input_ids"].shape)
    assert shape == (2, 13)
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel_size = 2: batch rows 0\.\.1 are 13 "
        r"tokens long, not a multiple of 2 \(13 % 2 = 1\); XTuner's "
        r"split_for_sequence_parallel asserts.*rope_collate_fn\(\.\.\., "
        r"pad_to_multiple_of=2\)",
    ):
        check_sequence_parallel_rows(shape, 2, pads_itself=False)
    with pytest.raises(ValueError, match=r"are 3 tokens long \(shorter than the 4 shards\)"):
        check_sequence_parallel_rows((1, 3), 4, pads_itself=False)
    check_sequence_parallel_rows(shape, 2, pads_itself=True)  # the plugin's loss pads itself
    check_sequence_parallel_rows(shape, 1, pads_itself=False)  # no sequence parallel


def test_rope_collate_fn_padded_to_the_size_passes():
    batch = rope_collate_fn(_items([9, 13, 5]), pack=True, max_length=64, pad_to_multiple_of=4)
    b, s = batch["data"]["input_ids"].shape
    assert s % 4 == 0
    check_sequence_parallel_rows((b, s), 4, pads_itself=False)


def test_check_hook_refuses_an_indivisible_train_batch_on_an_unpatched_model(tmp_path, monkeypatch):
    runner = tiny_runner(tmp_path)
    hook = PackedBatchCheckHook()
    hook.before_train(runner)  # no ValidatedRoPEHook: XTuner's own SP loss would run
    batch = rope_collate_fn(_items([9, 12]), pack=False)  # [2, 12] padded rows
    hook.before_train_iter(runner, 0, batch)  # one process: no sequence parallel
    monkeypatch.setattr(hooks_module, "sequence_parallel_size", lambda: 5)
    batch = rope_collate_fn(_items([9, 12]), pack=False)
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel_size = 5: batch rows 0\.\.1 are 12 "
        r"tokens long.*pad_to_multiple_of=5",
    ):
        hook.before_train_iter(runner, 0, batch)
    hook.after_train_iter(runner, 0)


# The doctor and the start-up on XTuner's stock sequence-parallel config (copied with
# `xtuner copy-cfg`, the user's local edits and the README's one edit), tiny InternLM2 (4 heads).
STOCK = "internlm2_7b_full_finetune_custom_dataset_e1_sequence_parallel_4"


def _sp_config(stock: Path, data: Path, sp: int) -> Path:
    text = sc.enable_plugin(sc.localize(stock, data))
    text = sc.sub_once(text, r"^sequence_parallel_size = 4$", f"sequence_parallel_size = {sp}")
    text = sc.sub_once(text, r"^max_length = 512$", "max_length = 255")  # odd rows
    path = stock.parent / f"sp{sp}.py"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sp_configs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp_doctor")
    sc.ensure_tiny_model()
    stock = sc.copy_stock(STOCK, tmp / "stock")
    data = sc.write_conversation_data(tmp / "data.json", n=200)
    return {sp: _sp_config(stock, data, sp) for sp in (2, 3)}


def test_doctor_reports_rows_against_the_sequence_parallel_size(sp_configs):
    report, _ = diagnose(str(sp_configs[2]), progress=False)
    missing = cpu_only() and gloo_all_to_all_missing()
    if missing:  # torch 2.4.1 on CPU: the run cannot exchange shards, the doctor says so
        assert report["exit_code"] == 1
        assert any(missing in p for p in report["problems"]), report["problems"]
        pytest.skip(f"sequence parallel refused on this CPU: {missing}")
    figures, collate = report["sequence_parallel"], report["collate"]
    assert report["exit_code"] == 0, report["problems"]
    assert collate["batches"] == collate["batches_total"]  # every row collated (batch size 1)
    rows = figures["rows"]
    assert figures["size"] == 2 and rows["count"] == report["dataset"]["samples"]
    assert rows["shorter_than_size"]["count"] == 0
    # Cross-check with the real collate function: rope_collate_fn(pad_to_multiple_of=2), set
    # by the start-up, pads each odd row by exactly the padding segment the figures count.
    assert rows["padding_tokens"] == collate["config_slots"] - collate["real_tokens"] > 0
    assert rows["needing_padding"] == rows["padding_tokens"]  # sp = 2: one token per odd row
    assert rows["padding_share"] == pytest.approx(rows["padding_tokens"] / collate["config_slots"])
    batches = figures["batches"]
    assert batches["not_divisible"] == 0 and batches["loss_padding_tokens"] == 0
    shortest = int(report["packing"]["row_lengths"]["p0"])  # the last row (lossless packing)
    # Rows of 255 tokens + 1 of padding, halved; the shortest row rounded up likewise.
    assert batches["shard_length"] == {"min": (shortest + shortest % 2) // 2, "max": 128}
    summary = format_summary(report)
    assert "seq-parallel size 2: " in summary and "per-rank shard" in summary


def test_doctor_fails_on_heads_not_divisible_by_the_size_on_cpu(sp_configs):
    report, _ = diagnose(str(sp_configs[3]), progress=False, batches=5)
    assert report["exit_code"] == 1
    assert any(
        re.search(
            r"conflict: sequence_parallel_size: 3 does not divide the 4 attention "
            r"heads \(from .*config\.json\).*\n  -> set sequence_parallel_size to a "
            r"divisor of 4 \(1, 2, 4\)",
            p,
        )
        for p in report["problems"]
    )
    assert report["sequence_parallel"]["size"] == 3


def test_start_up_refuses_heads_not_divisible_before_loading(sp_configs, monkeypatch):
    cfg = Config.fromfile(str(sp_configs[3]))
    with pytest.raises(
        ConfigConflict,
        match=r"sequence_parallel_size: 3 does not divide the 4 "
        r"attention heads \(from .*tiny-internlm2/config\.json\): XTuner's inner "
        r"sequence parallel.*refuses CPU tensors.*\n  -> set "
        r"sequence_parallel_size to a divisor of 4 \(1, 2, 4\), or train on GPUs",
    ):
        startup.prepare_config(cfg)
    ok = Config.fromfile(str(sp_configs[2]))
    assert not any("attention heads" in f.problem for f in startup.inspect_config(ok))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id whose config.json cannot be read
    ok.model.llm.pretrained_model_name_or_path = "internlm/internlm2-7b"  # not downloaded
    ok.sequence_parallel_size = 3
    assert not any("attention heads" in f.problem for f in startup.inspect_config(ok))
