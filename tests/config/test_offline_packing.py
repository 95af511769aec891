"""XTuner's intern-repo datasets (``build_packed_dataset``) pack offline, whatever the config
says: the start-up keeps their boundaries through ``default_collate_fn`` (its
``use_varlen_attn=True``), refuses a batch size it cannot serve, and the batch hook knows the
rows are packed. The real run is ``tests/zoo/test_intern_repo.py``'s slow test.
"""

import pytest
import torch
from mmengine.config import Config

from xtuner_rope.config.startup import ConfigConflict, packing_source, prepare_config
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
