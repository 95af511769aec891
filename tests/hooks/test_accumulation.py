"""Checkpoints at accumulation-window boundaries, and the refusal of a mid-window resume.

The real kill-and-resume runs are in tests/integration/test_resume.py; here the start-up's
interval fix and the resume check on their own, on MMEngine's real ``OptimWrapper``,
``DeepSpeedOptimWrapper`` and ``MessageHub``.
"""

import itertools
import types

import pytest
import torch
from mmengine._strategy.deepspeed import DeepSpeedOptimWrapper
from mmengine.config import Config
from mmengine.logging import MessageHub
from mmengine.optim import OptimWrapper

from xtuner_rope.config.accumulation import checkpoint_interval_findings
from xtuner_rope.hooks.accumulation import (
    WINDOW_KEY,
    MidWindowResumeError,
    accumulation_state,
    check_resume,
)

_HUBS = itertools.count()


def _cfg(interval=500, counts=16, by_epoch=False, **hook):
    return Config(
        dict(
            optim_wrapper=dict(type="OptimWrapper", accumulative_counts=counts),
            default_hooks=dict(
                checkpoint=dict(type="CheckpointHook", by_epoch=by_epoch, interval=interval, **hook)
            ),
        )
    )


def test_checkpoint_interval_is_raised_to_the_next_window_boundary():
    cfg = _cfg(interval=500, counts=16, save_begin=10)
    interval, begin = checkpoint_interval_findings(cfg)
    assert interval.setting == "default_hooks.checkpoint.interval"
    assert "500 iterations is not a multiple of accumulative_counts=16" in interval.problem
    assert interval.edit.startswith("set to 512 (the next multiple of 16)")
    interval.fix()
    begin.fix()
    assert cfg.default_hooks.checkpoint.interval == 512
    assert cfg.default_hooks.checkpoint.save_begin == 16
    assert checkpoint_interval_findings(cfg) == []


@pytest.mark.parametrize(
    "cfg",
    [_cfg(interval=512), _cfg(counts=1), _cfg(by_epoch=True, interval=3), Config(dict())],
    ids=["aligned", "no-accumulation", "epoch-checkpoints", "no-hook"],
)
def test_nothing_to_align(cfg):
    assert checkpoint_interval_findings(cfg) == []


def _optim_wrapper(counts: int, done: int) -> OptimWrapper:
    wrapper = OptimWrapper(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0),
        accumulative_counts=counts,
    )
    wrapper.initialize_count_status(torch.nn.Linear(1, 1), done, 100)
    return wrapper


def _runner(done: int, counts: int = 4, record=None, cfg=None):
    hub = MessageHub.get_instance(f"test_accumulation_{next(_HUBS)}")
    if record is not None:
        hub.update_info(WINDOW_KEY, record)
    return types.SimpleNamespace(
        iter=done, optim_wrapper=_optim_wrapper(counts, done), message_hub=hub, cfg=cfg or {}
    )


def test_window_state_of_both_optimizer_wrappers():
    assert accumulation_state(_optim_wrapper(4, 6)) == (4, True)
    assert accumulation_state(_optim_wrapper(4, 8)) == (4, False)
    assert accumulation_state(_optim_wrapper(1, 7)) == (1, False)
    deepspeed = DeepSpeedOptimWrapper(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))
    deepspeed.model = types.SimpleNamespace(gradient_accumulation_steps=lambda: 4, micro_steps=6)
    assert accumulation_state(deepspeed) == (4, True)
    deepspeed.model.micro_steps = 8
    assert accumulation_state(deepspeed) == (4, False)


def test_resume_from_a_checkpoint_written_inside_a_window_is_refused():
    with pytest.raises(
        MidWindowResumeError,
        match=r"--resume from iteration 6: the checkpoint was written inside an accumulation "
        r"window \(accumulative_counts=4\), and the gradients of its 2 micro-batch\(es\) since "
        r"iteration 4 are in no checkpoint .* \(iter_4 or earlier; .* set resume_mid_window = "
        r"True",
    ):
        check_resume(_runner(6, record={"counts": 4, "open": True}))
    with pytest.raises(MidWindowResumeError, match="iteration 6"):
        check_resume(_runner(6))  # written without the record (another tool): by its number


def test_resume_at_a_boundary_or_after_a_closed_window_goes_on():
    check_resume(_runner(0))  # a fresh run
    check_resume(_runner(8))
    check_resume(_runner(8, record={"counts": 4, "open": False}))
    check_resume(_runner(6, record={"counts": 4, "open": False}))  # the end of its run: stepped
    check_resume(_runner(6, cfg={"resume_mid_window": True}))  # the opt-out
