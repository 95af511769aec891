"""The doctor's warm-up prediction against MMEngine's own scheduler construction (fast, no run).

XTuner's ``qwen1_5_0_5b_full_custom_pretrain_e1`` on small data: ``warmup_ratio * max_epochs``
of an epoch rounds to 0 iterations and the Runner stops with ``end should be larger than
begin``. The doctor must say so exactly when MMEngine refuses the scheduler.
"""

import pytest
import torch
from mmengine.optim import OptimWrapper
from mmengine.optim.scheduler import CosineAnnealingLR, LinearLR

from xtuner_rope.doctor.schedule import epoch_length, schedule_problems


def stock_schedule(warmup_ratio: float, max_epochs: int) -> list[dict]:
    """The ``param_scheduler`` of XTuner 0.2.0's stock configs (PART 4)."""
    return [
        dict(
            type=LinearLR,
            start_factor=1e-5,
            by_epoch=True,
            begin=0,
            end=warmup_ratio * max_epochs,
            convert_to_iter_based=True,
        ),
        dict(
            type=CosineAnnealingLR,
            eta_min=0.0,
            by_epoch=True,
            begin=warmup_ratio * max_epochs,
            end=max_epochs,
            convert_to_iter_based=True,
        ),
    ]


def build_like_runner(schedulers: list[dict], length: int) -> None:
    """Build every scheduler as MMEngine's Runner does (raises what the Runner would)."""
    from mmengine.registry import PARAM_SCHEDULERS

    model = torch.nn.Linear(2, 2)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    for scheduler in schedulers:
        PARAM_SCHEDULERS.build(
            dict(scheduler), default_args=dict(optimizer=wrapper, epoch_length=length)
        )


@pytest.mark.parametrize(
    "samples,batch_size,warmup_ratio,max_epochs",
    [
        (6, 1, 0.03, 1),  # the zoo's pretrain row: 6 packs, warm-up 0.18 iterations
        (33, 1, 0.03, 1),  # 0.99 iterations: still 0
        (34, 1, 0.03, 1),  # 1.02: 1 iteration, trains
        (12, 1, 0.03, 3),  # the alpaca configs (3 epochs): 1.08, trains
        (11, 1, 0.03, 3),  # 0.99: refused
        (67, 2, 0.03, 1),  # 34 batches of 2 (the last one short): trains
        (66, 2, 0.03, 1),  # 33 batches: refused
    ],
)
def test_doctor_predicts_mmengine(samples, batch_size, warmup_ratio, max_epochs):
    schedulers = stock_schedule(warmup_ratio, max_epochs)
    problems = schedule_problems(schedulers, samples, batch_size)
    length = epoch_length(samples, batch_size)
    if problems:
        with pytest.raises(ValueError, match="end should be larger than begin"):
            build_like_runner(schedulers, length)
        assert len(problems) == 1
        assert problems[0].startswith("param_scheduler[0]: LinearLR, begin=0")
        assert "warmup_ratio" in problems[0] and f"{length} iterations per epoch" in problems[0]
    else:
        build_like_runner(schedulers, length)


def test_iteration_schedules_and_open_ends_are_not_converted():
    assert schedule_problems(None, 1, 1) == []
    assert schedule_problems(dict(type=LinearLR, by_epoch=False, begin=0, end=10), 1, 1) == []
    assert schedule_problems([dict(type=LinearLR, begin=0, convert_to_iter_based=True)], 1, 1) == []
    # not converted: MMEngine keeps epochs (0 < 0.03), nothing to refuse
    assert schedule_problems([dict(type=LinearLR, begin=0, end=0.03)], 1, 1) == []


def test_doctor_exit_code_on_the_zoo_pretrain_row():
    """The report's problems carry the scheduler and the doctor's exit code is 1."""
    from xtuner_rope.doctor.judge import exit_code

    problems = schedule_problems(stock_schedule(0.03, 1), 6, 1)
    assert exit_code({"problems": problems}) == 1
    assert "begin=0, end=0 iterations" in problems[0]
    assert "warmup_ratio * max_epochs >= 0.167" in problems[0]
