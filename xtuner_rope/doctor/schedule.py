"""The doctor's check of the learning-rate schedule: MMEngine's epoch-to-iteration rounding.

On a small dataset ``int(end * len(train_dataloader))`` rounds a warm-up to 0 iterations and
MMEngine refuses ``end <= begin`` after loading; the doctor computes the same integers first.
"""

from __future__ import annotations

# The conversion's integers and the message are shared with the run's own refusal.
from xtuner_rope.config.warmup import INF, epoch_length, iteration_bounds, rounding_problems

__all__ = ["INF", "epoch_length", "iteration_bounds", "schedule_problems"]


def schedule_problems(
    param_scheduler, samples: int, batch_size: int, drop_last: bool = False
) -> list[str]:
    """One message (which, the integers, the edit) per scheduler of ``param_scheduler`` (a dict, a
    list, or None) MMEngine would refuse (``end <= begin`` once converted from epochs with
    ``samples`` train items, ``batch_size`` and ``drop_last``)."""
    length = epoch_length(samples, batch_size, drop_last)
    data = f"{samples} samples, batch size {batch_size}, 1 process"
    return [
        f"{setting}: {problem}\n  -> {edit}"
        for setting, problem, edit in rounding_problems(param_scheduler, length, data)
    ]
