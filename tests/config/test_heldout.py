"""Start-up findings of the held-out evaluation on XTuner's stock full fine-tune config, no run.

The real runs (`xtuner train`, 1 and 2 processes, against the plain reference) are in
tests/integration/test_heldout_train.py.
"""

from pathlib import Path

import heldout as ho
import pytest
import stock_configs as sc
from mmengine.config import Config

from xtuner_rope.compat.devices import cpu_only, gloo_all_to_all_missing
from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.config.fields import type_name
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.startup import inspect_config, prepare_config

FULL = "internlm2_chat_1_8b_full_alpaca_e3"


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stock")
    copy = sc.copy_stock(FULL, root)
    return {
        "text": sc.enable_plugin(sc.localize(copy, sc.write_alpaca_data(root / "alpaca", n=8))),
        "held": ho.write_heldout_data(root / "held", n=6),
    }


def _cfg(stock: dict, tmp_path: Path, held: Path | None = None, *edits) -> Config:
    text = ho.with_heldout(stock["text"], held or stock["held"])
    for pattern, repl in edits:
        text = sc.sub_once(text, pattern, repl)
    path = tmp_path / "cfg.py"
    path.write_text(text)
    return Config.fromfile(str(path))


def _settings(findings, fixed: bool) -> list[str]:
    return sorted(f.setting for f in findings if (f.fix is not None) == fixed)


def test_heldout_loader_gets_what_the_train_loader_gets(stock, tmp_path):
    cfg = _cfg(stock, tmp_path)
    findings = inspect_config(cfg)
    assert not _settings(findings, fixed=False), [str(f) for f in findings]
    prepare_config(cfg)
    val = config_dict(cfg)["val_dataloader"]
    dataset = val["dataset"]
    assert type_name(dataset["type"]) == "heldout_process_hf_dataset"
    assert dataset["use_varlen_attn"] and not dataset["shuffle_before_pack"]
    assert val["collate_fn"]["use_varlen_attn"] is True
    assert val["sampler"]["shuffle"] is False
    assert config_dict(cfg)["val_evaluator"]["tokenizer"] is config_dict(cfg)["tokenizer"]
    hooks = [type_name(h["type"]) for h in config_dict(cfg)["custom_hooks"]]
    assert "HeldOutCurvesHook" in hooks and "PackedBatchCheckHook" in hooks
    custom = config_dict(cfg)["log_processor"]["custom_cfg"]
    assert dict(data_src="heldout_loss", method_name="mean", window_size=1) in custom
    assert config_dict(cfg)["log_processor"]["by_epoch"] is False  # the stock entry is kept


def test_sequence_parallel_heldout_rows_collate_whole(stock, tmp_path):
    cfg = _cfg(
        stock, tmp_path, None, (r"^sequence_parallel_size = 1$", "sequence_parallel_size = 2")
    )
    missing = cpu_only() and gloo_all_to_all_missing()
    if missing:  # torch 2.4.1 on CPU: sequence parallel refused, nothing to collate
        with pytest.raises(ConfigConflict, match="has no all_to_all"):
            prepare_config(cfg)
        pytest.skip(f"sequence parallel refused on this CPU: {missing}")
    prepare_config(cfg)
    collate = config_dict(cfg)["val_dataloader"]["collate_fn"]
    # XTuner's default_collate_fn asserts rows divisible by 2; held-out rows are whole dialogues
    assert type_name(collate["type"]) == "rope_collate_fn" and collate["use_varlen_attn"] is True
    assert "pad_to_multiple_of" not in collate  # evaluated whole, never split


def test_missing_heldout_file_is_refused(stock, tmp_path):
    cfg = _cfg(stock, tmp_path, tmp_path / "nowhere")
    with pytest.raises(ConfigConflict, match=r"held-out data .*nowhere.*does not exist"):
        prepare_config(cfg)


def test_empty_heldout_file_is_refused(stock, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.json").write_text("[]")
    with pytest.raises(ConfigConflict, match=r"held-out data file holds no dialogue \(empty\)"):
        prepare_config(_cfg(stock, tmp_path, empty))


def test_val_interval_beyond_the_run_is_refused(stock, tmp_path):
    edit = (
        r"^train_cfg = dict\(type=TrainLoop, max_epochs=max_epochs\)$",
        "train_cfg = dict(type=TrainLoop, max_iters=8, val_interval=10)",
    )
    with pytest.raises(ConfigConflict, match=r"val_interval: 10 is beyond the run's max_iters=8"):
        prepare_config(_cfg(stock, tmp_path, None, edit))


def test_metric_on_a_model_it_cannot_serve_is_refused(stock, tmp_path):
    edit = (r"^    type=SupervisedFinetune,$", '    type="DPO",')
    cfg = _cfg(stock, tmp_path, None, edit)
    with pytest.raises(
        ConfigConflict,
        match=r"TokenLossMetric scores .* this config's model is DPO\n.*-> use "
        r"val_evaluator=dict\(type=PreferenceMetric\)",
    ):
        prepare_config(cfg)
    text = ho.with_heldout(stock["text"], stock["held"]).replace(
        "val_evaluator = dict(type=TokenLossMetric)",
        "from xtuner_rope import PreferenceMetric\nval_evaluator = dict(type=PreferenceMetric)",
    )
    (tmp_path / "pref_metric.py").write_text(text)
    with pytest.raises(
        ConfigConflict,
        match=r"PreferenceMetric scores the pairs of XTuner's DPO, ORPO and RewardModel; this "
        r"config's model is SupervisedFinetune\n.*-> use val_evaluator=dict\(type=TokenLossMetric",
    ):
        prepare_config(Config.fromfile(str(tmp_path / "pref_metric.py")))


def test_shuffling_or_other_samplers_and_batched_packs(stock, tmp_path):
    edits = [
        (
            r"^    sampler=dict\(type=DefaultSampler, shuffle=False\),$",
            '    sampler=dict(type="LengthGroupedSampler"),',
        ),
        (
            r"^    batch_size=1,\n    num_workers=0,\n    dataset=dict\(\n        type=process_hf_dataset,\n        dataset=dict\(type=load_dataset, path=\"(.*held)\"\)",
            '    batch_size=2,\n    num_workers=0,\n    dataset=dict(\n        type=process_hf_dataset,\n        dataset=dict(type=load_dataset, path="\\1")',
        ),
    ]
    findings = inspect_config(_cfg(stock, tmp_path, None, *edits))
    assert _settings(findings, fixed=False) == [
        "val_dataloader.batch_size",
        "val_dataloader.sampler",
    ]


def test_metric_without_heldout_loader_is_refused(stock, tmp_path):
    text = (
        stock["text"]
        + "\nfrom xtuner_rope import TokenLossMetric\nval_evaluator = dict(type=TokenLossMetric)\n"
    )
    path = tmp_path / "cfg.py"
    path.write_text(text)
    with pytest.raises(
        ConfigConflict, match=r"val_dataloader: missing: val_evaluator=dict\(type=TokenLossMetric\)"
    ):
        prepare_config(Config.fromfile(str(path)))


def _shortcut_cfg(stock: dict, tmp_path: Path, line: str) -> Config:
    text = sc.sub_once(stock["text"], r"^(max_length = \d+\n)", r"\g<1>" + line + "\n")
    path = tmp_path / "shortcut.py"
    path.write_text(text)
    return Config.fromfile(str(path))


def test_shortcut_fraction_holds_out_disjoint_dialogues(stock, tmp_path):
    from datasets import load_dataset

    cfg = _shortcut_cfg(stock, tmp_path, "heldout = dict(fraction=0.25, interval=2)")
    prepare_config(cfg)
    train = config_dict(cfg)["train_dataloader"]["dataset"]["dataset"]
    val = config_dict(cfg)["val_dataloader"]["dataset"]
    assert train["split"] == "train[:75%]" and val["dataset"]["split"] == "train[75%:]"
    assert type_name(val["type"]) == "heldout_process_hf_dataset"
    assert "whole_dialogues" in config_dict(cfg)["train_dataloader"]["dataset"]
    # copied from the training dict the start-up made lossless_process_hf_dataset: its own
    # argument must not reach heldout_process_hf_dataset (process_hf_dataset refuses it)
    assert "whole_dialogues" not in val
    assert type_name(config_dict(cfg)["val_evaluator"]["type"]) == "TokenLossMetric"
    assert config_dict(cfg)["train_cfg"]["val_interval"] == 2
    assert config_dict(cfg)["val_dataloader"]["sampler"]["shuffle"] is False
    path = train["path"]
    kept = list(load_dataset(path, split=train["split"])["instruction"])
    held = list(load_dataset(path, split=val["dataset"]["split"])["instruction"])
    everything = list(load_dataset(path, split="train")["instruction"])
    assert len(held) == 2 and len(kept) == 6 and sorted(kept + held) == sorted(everything)
    assert not set(kept) & set(held)


def test_shortcut_other_file(stock, tmp_path):
    cfg = _shortcut_cfg(stock, tmp_path, f'heldout = dict(data_files="{stock["held"]}/train.json")')
    prepare_config(cfg)
    node = config_dict(cfg)["val_dataloader"]["dataset"]["dataset"]
    assert node["path"] == "json" and node["data_files"] == dict(
        train=f"{stock['held']}/train.json"
    )
    assert "split" not in config_dict(cfg)["train_dataloader"]["dataset"]["dataset"]


def test_shortcut_bad_settings_are_refused(stock, tmp_path):
    with pytest.raises(
        ConfigConflict, match=r"heldout: fraction must be a float in \(0, 1\) in whole"
    ):
        prepare_config(_shortcut_cfg(stock, tmp_path, "heldout = dict(fraction=0.333)"))
    with pytest.raises(
        ConfigConflict, match=r"expected dict\(data_files=PATH\) or dict\(fraction=F\)"
    ):
        prepare_config(
            _shortcut_cfg(stock, tmp_path, "heldout = dict(fraction=0.1, data_files='x')")
        )


def test_shortcut_on_stock_dpo_picks_the_preference_metric(tmp_path):
    """``heldout = dict(fraction=0.1)`` on XTuner's stock DPO: ``PreferenceMetric``, the last
    10% of the pairs file held out, packed in file order, the training pairs' checks."""
    import preference_configs as pc

    sc.ensure_tiny_model()
    data = pc.write_preference_pairs(tmp_path / "pairs.jsonl", n=20)
    text = pc.localize_preference(sc.copy_stock(pc.DPO, tmp_path), pc.DPO, data)
    path = tmp_path / "dpo.py"
    path.write_text(sc.enable_plugin(text) + "\nheldout = dict(fraction=0.1)\n")
    cfg = Config.fromfile(str(path))
    prepare_config(cfg)
    assert type_name(config_dict(cfg)["val_evaluator"]["type"]) == "PreferenceMetric"
    val = config_dict(cfg)["val_dataloader"]
    assert val["dataset"]["dataset"]["split"] == "train[90%:]"
    assert config_dict(cfg)["train_dataloader"]["dataset"]["dataset"]["split"] == "train[:90%]"
    assert val["dataset"]["shuffle_before_pack"] is False and val["sampler"]["shuffle"] is False
    hooks = [type_name(h["type"]) for h in config_dict(cfg)["custom_hooks"]]
    assert "HeldOutCurvesHook" in hooks
    from xtuner_rope.config.heldout.models import heldout_pairs_findings

    assert heldout_pairs_findings(cfg) == []
    val["collate_fn"]["use_varlen_attn"] = False  # checked as the training pairs are
    (finding,) = heldout_pairs_findings(cfg)
    assert "val_dataloader.collate_fn.use_varlen_attn=False" in finding.problem, finding


def test_shortcut_on_stock_llava_and_internvl_takes_their_data_file(tmp_path):
    """LLaVA / InternVL configs: ``data_files`` (and ``image_folder``) become the held-out
    dataset's own file fields, ``TokenLossMetric`` serves the model; ``fraction`` (no
    ``load_dataset`` to slice) and ``image_folder`` on text data are refused."""
    import internvl_configs as ic
    import llava_configs as lc

    from xtuner_rope.demo.llava_data import write_llava_data

    assets = lc.llava_assets(tmp_path / "llava")
    held = write_llava_data(tmp_path / "held", n_images=2, n_text=2, seed=1)
    text = lc.localize_llava(assets["finetune"], assets["llm"], assets["clip"], assets["data"])
    line = f'heldout = dict(data_files="{held}", image_folder="{held.parent}/images")'
    path = tmp_path / "llava.py"
    path.write_text(lc.enable_plugin_llava(text) + f"\n{line}\n")
    cfg = Config.fromfile(str(path))
    prepare_config(cfg)
    val = config_dict(cfg)["val_dataloader"]
    assert type_name(config_dict(cfg)["val_evaluator"]["type"]) == "TokenLossMetric"
    assert val["dataset"]["data_path"] == str(held)
    assert val["dataset"]["image_folder"] == f"{held.parent}/images"
    assert type_name(val["sampler"]["type"]) == "DefaultSampler" and not val["sampler"]["shuffle"]
    path.write_text(lc.enable_plugin_llava(text) + "\nheldout = dict(fraction=0.1)\n")
    with pytest.raises(ConfigConflict, match=r"heldout: fraction needs datasets' split slicing"):
        prepare_config(Config.fromfile(str(path)))
    internvl = ic.internvl_assets(tmp_path / "internvl")
    text = ic.localize_internvl(internvl[ic.PHI3_FULL], internvl["phi3"], internvl["data"])
    path = tmp_path / "internvl.py"
    path.write_text(ic.enable_plugin_internvl(text) + f'\nheldout = dict(data_files="{held}")\n')
    cfg = Config.fromfile(str(path))
    prepare_config(cfg)
    dataset = config_dict(cfg)["val_dataloader"]["dataset"]
    assert dataset["data_paths"] == [str(held)] and len(dataset["image_folders"]) == 1
    assert type_name(config_dict(cfg)["val_evaluator"]["type"]) == "TokenLossMetric"


def test_shortcut_image_folder_on_text_data_is_refused(stock, tmp_path):
    line = f'heldout = dict(data_files="{stock["held"]}/train.json", image_folder="x")'
    with pytest.raises(ConfigConflict, match=r"heldout: image_folder is for LLaVA / InternVL"):
        prepare_config(_shortcut_cfg(stock, tmp_path, line))
