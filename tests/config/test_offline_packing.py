"""XTuner's intern-repo datasets (``build_packed_dataset``) pack offline, whatever the config
says: the start-up keeps their boundaries through ``default_collate_fn`` (its
``use_varlen_attn=True``), refuses a batch size it cannot serve, and the batch hook knows the
rows are packed. The real run is ``tests/zoo/test_intern_repo.py``'s slow test.
"""

import pytest
import torch
from mmengine.config import Config

from xtuner_rope.config.fields import packing_source, type_name
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.startup import prepare_config
from xtuner_rope.hooks.isolation import refuse_unbounded_packing


def _cfg(batch_size: int = 1, varlen: bool = False) -> Config:
    dataset = dict(
        type="build_packed_dataset",
        dataset_cfg=dict(type="load_intern_repo_tokenized_dataset", folder="/data"),
        packed_length=512,
    )
    collate = dict(type="default_collate_fn", use_varlen_attn=varlen)
    loader = dict(batch_size=batch_size, dataset=dataset, collate_fn=collate)
    return Config(dict(train_dataloader=loader))


def test_the_collate_function_keeps_the_offline_packs_boundaries():
    cfg = _cfg()
    fixes = [f.setting for f in prepare_config(cfg)]
    assert "train_dataloader.collate_fn.use_varlen_attn" in fixes
    assert cfg.train_dataloader.collate_fn.use_varlen_attn is True
    assert "use_varlen_attn" not in cfg.train_dataloader.dataset  # no such argument there
    assert packing_source(cfg) == (
        "train_dataloader.dataset (build_packed_dataset: intern-repo documents packed offline)"
    )


def test_offline_packs_in_batches_of_two_are_refused_with_the_collate_function_to_use():
    with pytest.raises(
        ConfigConflict,
        match=r"train_dataloader\.collate_fn: packed rows: XTuner's default_collate_fn keeps "
        r"document boundaries only at batch_size=1, got 2\n  -> use collate_fn=dict\("
        r"type=rope_collate_fn",
    ):
        prepare_config(_cfg(batch_size=2, varlen=True))


def test_offline_packs_reaching_the_model_without_boundaries_stop_at_the_first_batch():
    leaky = {
        "input_ids": torch.ones(1, 12, dtype=torch.long),
        "position_ids": torch.arange(12)[None],
    }
    with pytest.raises(
        ValueError,
        match=r"packed \(train_dataloader\.dataset \(build_packed_dataset: intern-repo documents "
        r"packed offline\)\) but reach the model without document boundaries.*set "
        r"use_varlen_attn=True on default_collate_fn",
    ):
        refuse_unbounded_packing(leaky, [], packing_source(_cfg()))


def _hf_cfg(offline_packing: object = None, type_: str = "process_hf_dataset", **extra) -> Config:
    dataset = dict(type=type_, max_length=64, pack_to_max_length=True, use_varlen_attn=True)
    loader = dict(
        batch_size=1,
        dataset=dict(dataset, **extra),
        collate_fn=dict(type="default_collate_fn", use_varlen_attn=True),
    )
    top = {} if offline_packing is None else {"offline_packing": offline_packing}
    return Config(dict(train_dataloader=loader, **top))


def test_xtuners_packing_becomes_whole_dialogue_packing_by_default():
    cfg = _hf_cfg()
    fixes = {f.setting: f for f in prepare_config(cfg)}
    fix = fixes["train_dataloader.dataset.type"]
    assert "cuts the dialogues at every max_length tokens" in fix.problem
    assert fix.edit.startswith("set to lossless_process_hf_dataset(whole_dialogues=True)")
    assert 'Opt out: offline_packing = "cut"' in fix.edit
    assert "rows per epoch changes" in fix.edit
    dataset = cfg.train_dataloader.dataset
    assert type_name(dataset.type) == "lossless_process_hf_dataset"
    assert dataset.whole_dialogues is True


def test_the_cut_opt_out_keeps_xtuners_cut_and_says_so():
    cfg = _hf_cfg("cut")
    fix = {f.setting: f for f in prepare_config(cfg)}["train_dataloader.dataset.type"]
    assert fix.edit.startswith("set to lossless_process_hf_dataset(whole_dialogues=False)")
    assert "dialogues across a row edge are trained as pieces" in fix.edit
    assert cfg.train_dataloader.dataset.whole_dialogues is False


@pytest.mark.parametrize("mode, whole", [("cut", False), ("whole", True)])
def test_a_lossless_dataset_follows_the_top_level_setting(mode, whole):
    cfg = _hf_cfg(mode, "lossless_process_hf_dataset", whole_dialogues=not whole)
    fixes = [f.setting for f in prepare_config(cfg)]
    assert "train_dataloader.dataset.whole_dialogues" in fixes
    assert "train_dataloader.dataset.type" not in fixes
    assert cfg.train_dataloader.dataset.whole_dialogues is whole


def test_an_unknown_offline_packing_is_refused_with_the_choices():
    with pytest.raises(
        ConfigConflict,
        match=r"offline_packing: expected one of \('whole', 'cut'\), got 'whole_rows'\n  -> set "
        r'offline_packing = "whole" \(the default',
    ):
        prepare_config(_hf_cfg("whole_rows"))


def test_whole_dialogues_of_the_wrong_type_is_refused_by_the_builder():
    from xtuner_rope.data.packed_dataset import lossless_process_hf_dataset

    with pytest.raises(TypeError, match=r"whole_dialogues: expected True or False, got 'yes'"):
        lossless_process_hf_dataset(None, whole_dialogues="yes")
