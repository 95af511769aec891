"""Sequence parallel at start-up: what is served, what is refused, XTuner's checks around it."""

from argparse import Namespace

import pytest
from mmengine.config import Config

from xtuner_rope.compat import devices, xtuner_sft
from xtuner_rope.config import startup
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.startup import prepare_config


def _sp_cfg(sp, model_type="SupervisedFinetune") -> Config:
    return Config(dict(sequence_parallel_size=sp, model=dict(type=model_type)))


def test_sequence_parallel_outside_sft_is_refused_with_the_edit():
    with pytest.raises(
        ConfigConflict,
        match=r"sequence_parallel_size: 2 with model type DPO: "
        r"xtuner-rope serves sequence parallel for SupervisedFinetune \(SFT\) "
        r"only.*\n  -> set sequence_parallel_size = 1 for this model",
    ):
        prepare_config(_sp_cfg(2, "DPO"))


@pytest.mark.parametrize("sp", [0, -2, 1.5, True, "2"])
def test_sequence_parallel_size_not_a_positive_int_is_refused(sp):
    with pytest.raises(ConfigConflict, match=r"sequence_parallel_size: .* is not a positive int"):
        prepare_config(_sp_cfg(sp))


@pytest.fixture
def train_module(monkeypatch):
    """``xtuner/tools/train.py`` loaded, with its ``check_cfg`` wrapped by compat."""
    import xtuner.tools.train as train

    # XTuner's own check_cfg (unwrapped if a test before this one in the process wrapped it),
    # put back as it was after the test
    monkeypatch.setattr(
        train, "check_cfg", getattr(train.check_cfg, "__wrapped__", train.check_cfg)
    )
    assert xtuner_sft.patch_xtuner_train_sequence_parallel_check()
    assert not xtuner_sft.patch_xtuner_train_sequence_parallel_check()  # idempotent
    return train


def test_xtuner_flash_attn_check_for_sequence_parallel_is_lifted_when_prepared(
    train_module, monkeypatch
):
    cfg = Config(dict(sequence_parallel_size=2, model=dict(llm=dict(attn_implementation="sdpa"))))
    monkeypatch.setitem(startup._STATE, "prepared", False)  # the plugin is off: XTuner's check
    with pytest.raises(
        AssertionError, match="`flash_attn` is required if you want to use sequence parallel"
    ):
        train_module.check_cfg(cfg, Namespace(deepspeed="zero2.json"))
    monkeypatch.setitem(startup._STATE, "prepared", True)
    train_module.check_cfg(cfg, Namespace(deepspeed="zero2.json"))
    assert cfg.sequence_parallel_size == 2  # the config itself is left as it was


def test_sequence_parallel_without_deepspeed_is_refused_with_the_edit(train_module, monkeypatch):
    monkeypatch.setitem(startup._STATE, "prepared", True)
    with pytest.raises(
        ValueError,
        match=r"(?s)sequence_parallel_size = 2 without DeepSpeed: .*Add "
        r"`--deepspeed <json>` to `xtuner train` \(on CPU: "
        r"configs/deepspeed/zero2_fp32_cpu.json\)",
    ):
        train_module.check_cfg(_sp_cfg(2), Namespace(deepspeed=None))


def test_heads_not_divisible_by_the_size_on_cpu_are_refused(monkeypatch):
    import torch

    from xtuner_rope.models import sequence_parallel

    monkeypatch.setattr(sequence_parallel, "sequence_parallel_size", lambda: 2)
    q = torch.zeros(1, 4, 3, 16)  # [b, s/sp, n_h, h_d]: 3 heads, sp 2
    k = v = torch.zeros(1, 4, 1, 16)
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel_size = 2 does not divide the 3 "
        r"attention heads: .*refuses CPU tensors .*Set sequence_parallel_size to "
        r"a divisor of 3, or train on GPUs",
    ):
        sequence_parallel.sequence_parallel_attention(q, k, v, eager=False)


def test_sequence_parallel_on_cpu_is_refused_where_gloo_has_no_all_to_all():
    """Probed, not by version: torch 2.4.1's gloo lacks all_to_all (refused at start-up, the
    torch named), 2.14.1's and 2.15.0's have it (served: nothing found for this config)."""
    import torch

    from xtuner_rope.config.sequence_parallel import sequence_parallel_heads_findings

    missing = devices.gloo_all_to_all_missing()
    findings = sequence_parallel_heads_findings(_sp_cfg(2))  # no checkpoint: no heads to check
    if missing is None:
        assert findings == []
        return
    assert f"torch {torch.__version__}'s gloo backend has no all_to_all" in missing
    (finding,) = findings
    assert finding.setting == "sequence_parallel_size" and missing in finding.problem
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)sequence_parallel_size: 2 on a CPU-only machine: .*all_to_all.*"
        r"set sequence_parallel_size = 1, or install a torch whose gloo has all_to_all",
    ):
        prepare_config(_sp_cfg(2))
