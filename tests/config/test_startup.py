"""Start-up checks and fixes on XTuner's own stock configs (`xtuner copy-cfg`), no training.

The end-to-end runs of the same configs through `xtuner train` are in test_stock_configs.py.
"""

from pathlib import Path

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config
from xtuner.registry import BUILDER

from xtuner_rope.compat.devices import cpu_only, gloo_all_to_all_missing
from xtuner_rope.config import startup
from xtuner_rope.config.fields import type_name
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.startup import inspect_config, prepare_config
from xtuner_rope.data.packed_dataset import lossless_process_hf_dataset

FULL = "internlm2_chat_1_8b_full_alpaca_e3"
QLORA = "internlm2_chat_1_8b_qlora_alpaca_e3"
VARLEN = "internlm2_7b_full_finetune_custom_dataset_e1"
CPU_ONLY = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> dict[str, Path]:
    """The three stock configs, copied once, localized (CPU edits included) and as shipped."""
    root = tmp_path_factory.mktemp("stock")
    data = sc.write_alpaca_data(root / "alpaca", n=8)
    conv = sc.write_conversation_data(root / "conv.json", n=8)
    out = {}
    for name in (FULL, QLORA, VARLEN):
        copy = sc.copy_stock(name, root)
        out[f"{name}/shipped"] = copy
        local = root / f"{name}_local.py"
        local.write_text(sc.localize(copy, conv if name == VARLEN else data))
        out[name] = local
    return out


def _cfg(path: Path, tmp_path: Path, *edits: tuple[str, str]) -> Config:
    """Load ``path`` after text edits (regex, replacement), each matching exactly once."""
    text = path.read_text()
    for pattern, repl in edits:
        text = sc.sub_once(text, pattern, repl)
    dst = tmp_path / path.name
    dst.write_text(text)
    return Config.fromfile(str(dst))


def _fixes(findings):
    return sorted(f.setting for f in findings if f.fix is not None)


def _conflicts(findings):
    return sorted(f.setting for f in findings if f.fix is None)


def test_stock_full_config_needs_only_fixes(stock, tmp_path):
    cfg = _cfg(stock[FULL], tmp_path)
    findings = inspect_config(cfg)
    assert _conflicts(findings) == []
    assert _fixes(findings) == [
        "custom_hooks",
        "train_dataloader.collate_fn.use_varlen_attn",
        "train_dataloader.dataset.type",
        "train_dataloader.dataset.use_varlen_attn",
    ]
    assert cfg.train_dataloader.dataset.use_varlen_attn is False  # inspect changes nothing
    prepare_config(cfg)
    assert cfg.train_dataloader.dataset.use_varlen_attn is True
    # XTuner's packing drops each map worker's leftover: the lossless builder, visible in a dump
    assert (
        type_name(dict.get(cfg.train_dataloader.dataset, "type")) == "lossless_process_hf_dataset"
    )
    dumped = tmp_path / "dumped.py"
    cfg.dump(str(dumped))
    name = Config.fromfile(str(dumped)).train_dataloader.dataset.type
    assert name == "xtuner_rope.data.packed_dataset.lossless_process_hf_dataset"
    assert BUILDER.get(name) is lossless_process_hf_dataset  # what xtuner train builds from it
    assert cfg.train_dataloader.collate_fn.use_varlen_attn is True
    hooks = [type_name(dict.get(h, "type")) for h in cfg.custom_hooks]
    assert hooks[:4] == [
        "ValidatedRoPEHook",
        "PackedBatchCheckHook",
        "PackingMetricsHook",
        "NonFiniteTripwireHook",
    ]
    assert inspect_config(cfg) == []  # prepared once, nothing left
    assert startup.is_prepared()


def test_stock_varlen_switch_works_without_flash_attn(stock, tmp_path):
    cfg = _cfg(stock[VARLEN], tmp_path)
    assert cfg.use_varlen_attn is True
    fixes = prepare_config(cfg)
    assert [f.setting for f in fixes] == [
        "use_varlen_attn",
        "custom_hooks",
        "train_dataloader.dataset.type",
        "custom_hooks",
    ]
    assert cfg.use_varlen_attn is False  # what XTuner's check_cfg reads
    assert cfg.model.use_varlen_attn is True and cfg.train_dataloader.dataset.use_varlen_attn
    names = [type_name(dict.get(h, "type")) for h in cfg.custom_hooks]
    assert "VarlenAttnArgsToMessageHubHook" not in names and "PackedBatchCheckHook" in names


def test_xtuner_default_packing_is_seen_when_the_setting_is_omitted(stock, tmp_path):
    """process_hf_dataset packs unless told otherwise: a config without the key packs too."""
    cfg = _cfg(stock[FULL], tmp_path, (r"^    pack_to_max_length=pack_to_max_length,\n", ""))
    assert "pack_to_max_length" not in cfg.train_dataloader.dataset
    assert _fixes(inspect_config(cfg)) == [
        "custom_hooks",
        "train_dataloader.collate_fn.use_varlen_attn",
        "train_dataloader.dataset.type",
        "train_dataloader.dataset.use_varlen_attn",
    ]


def test_rope_collate_fn_on_xtuner_packed_data_keeps_its_collate(stock, tmp_path):
    cfg = _cfg(
        stock[FULL],
        tmp_path,
        (
            r"^from xtuner.dataset.collate_fns import default_collate_fn$",
            "from xtuner_rope import rope_collate_fn",
        ),
        (
            r"collate_fn=dict\(type=default_collate_fn, use_varlen_attn=use_varlen_attn\)",
            "collate_fn=dict(type=rope_collate_fn, max_length=max_length)",
        ),
        (r"^batch_size = 1 ", "batch_size = 4 "),
    )
    assert _fixes(inspect_config(cfg)) == [
        "custom_hooks",
        "train_dataloader.dataset.type",
        "train_dataloader.dataset.use_varlen_attn",
    ]


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """No hub and an empty Hugging Face cache: the shipped configs' hub ids cannot be read."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))


UNREADABLE = (
    r"model\.llm\.pretrained_model_name_or_path: 'internlm/internlm2-chat-1_8b': its "
    r"config\.json cannot be read: no such local directory, and as a hub id it is not in the "
    r"local Hugging Face cache while offline mode is on"
)


@pytest.mark.skipif(not CPU_ONLY, reason="AmpOptimWrapper is fine on a GPU")
def test_amp_on_cpu_is_refused_with_the_edit(stock, tmp_path, offline_hub):
    cfg = Config.fromfile(str(stock[f"{FULL}/shipped"]))
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)2 setting\(s\).*optim_wrapper\.type: "
        r"AmpOptimWrapper needs a GPU.*use type=OptimWrapper .*delete its "
        rf"loss_scale and dtype.*{UNREADABLE}",
    ):
        prepare_config(cfg)


def test_default_collate_fn_with_packs_and_batch_size_above_one_is_refused(stock, tmp_path):
    cfg = _cfg(stock[FULL], tmp_path, (r"^batch_size = 1 ", "batch_size = 4 "))
    with pytest.raises(
        ConfigConflict,
        match=r"train_dataloader\.collate_fn: packed rows: "
        r"XTuner's default_collate_fn keeps document boundaries only at "
        r"batch_size=1, got 4\n  -> use collate_fn=dict\(type=rope_collate_fn",
    ):
        prepare_config(cfg)


def test_unknown_collate_fn_with_packs_is_refused(stock, tmp_path):
    cfg = _cfg(
        stock[FULL],
        tmp_path,
        (r"collate_fn=dict\(type=default_collate_fn,", "collate_fn=dict(type='my_collate',"),
    )
    with pytest.raises(
        ConfigConflict, match="collate function my_collate is not known to keep document boundaries"
    ):
        prepare_config(cfg)


def test_sequence_parallel_is_served_for_sft_and_a_bad_size_is_refused(stock, tmp_path):
    cfg = _cfg(
        stock[FULL], tmp_path, (r"^sequence_parallel_size = 1$", "sequence_parallel_size = 2")
    )
    missing = cpu_only() and gloo_all_to_all_missing()
    if missing:  # torch 2.4.1 on CPU: its gloo cannot exchange the shards
        with pytest.raises(ConfigConflict, match="has no all_to_all"):
            prepare_config(cfg)
    else:
        prepare_config(cfg)  # served: models.sequence_parallel (tests/test_sequence_parallel.py)
    cfg = _cfg(
        stock[FULL], tmp_path, (r"^sequence_parallel_size = 1$", "sequence_parallel_size = 0")
    )
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)sequence_parallel_size: 0 is not a positive "
        r"int\n  -> set sequence_parallel_size = 1 \(off\)",
    ):
        prepare_config(cfg)


@pytest.mark.skipif(not CPU_ONLY, reason="AmpOptimWrapper is fine on a GPU")
def test_every_conflict_is_listed_at_once(stock, tmp_path, offline_hub):
    cfg = _cfg(
        stock[f"{FULL}/shipped"],
        tmp_path,
        (r"^batch_size = 1 ", "batch_size = 2 "),
        (r"^sequence_parallel_size = 1$", "sequence_parallel_size = 0"),
    )
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)4 setting\(s\).*1\. train_dataloader"
        rf".*2\. optim_wrapper.*3\. sequence_parallel_size.*4\. {UNREADABLE}",
    ) as err:
        prepare_config(cfg)
    assert "custom_hooks" not in str(err.value)  # fixes are not conflicts


def test_a_config_not_prepared_at_start_up_is_refused_by_the_hook(stock, monkeypatch):
    cfg = Config.fromfile(str(stock[FULL]))
    monkeypatch.setitem(startup._STATE, "prepared", False)
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)ValidatedRoPEHook: xtuner-rope was loaded after "
        r"XTuner built the model.*model_resource = dict\(fn=enable_xtuner_rope\)",
    ):
        startup.require_prepared(cfg, "ValidatedRoPEHook")
    startup.require_prepared(Config(dict(a=1)), "ValidatedRoPEHook")  # built in code: not judged
    monkeypatch.setitem(startup._STATE, "prepared", True)
    startup.require_prepared(cfg, "ValidatedRoPEHook")


def test_enable_xtuner_rope_outside_xtuner_train_returns_the_path():
    assert (
        startup.enable_xtuner_rope("internlm/internlm2-chat-1_8b") == "internlm/internlm2-chat-1_8b"
    )


def test_xtuner_set_model_resource_prepares_the_config(stock, tmp_path, monkeypatch):
    """The real caller: xtuner.tools.utils.set_model_resource reads model_resource first."""
    from xtuner.tools.utils import set_model_resource

    cfg = Config.fromfile(str(stock[FULL]))
    cfg.model_resource = dict(fn=startup.enable_xtuner_rope)
    monkeypatch.setitem(startup._STATE, "prepared", False)
    set_model_resource(cfg)
    assert startup.is_prepared() and cfg.train_dataloader.dataset.use_varlen_attn is True


def test_boundaries_that_reach_the_model_name_the_missing_hook():
    from xtuner.model.sft import SupervisedFinetune

    data = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "cumulative_len": [None]}
    with pytest.raises(
        ValueError,
        match=r"(?s)reached the model with 'cumulative_len' still in it"
        r".*model_resource = dict\(fn=enable_xtuner_rope\)",
    ):
        SupervisedFinetune.forward(None, data)


def test_copy_stock_writes_what_xtuner_copy_cfg_writes(tmp_path):
    """The suite's and the zoo's ``copy_stock`` (``tools.zoo.run``: XTuner's copy steps in
    process) and the real command agree."""
    import subprocess

    name = "internlm2_chat_1_8b_qlora_alpaca_e3"
    proc = subprocess.run(
        ["xtuner", "copy-cfg", name, str(tmp_path / "cli")],
        env=sc.venv_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    copied = sc.copy_stock(name, tmp_path / "in_process")
    by_cli = tmp_path / "cli" / copied.name
    assert by_cli.read_bytes() == copied.read_bytes()
    with pytest.raises(KeyError, match="xtuner list-cfg"):
        sc.copy_stock("no_such_config", tmp_path / "none")
