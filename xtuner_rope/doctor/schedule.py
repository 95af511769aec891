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
    """The schedulers MMEngine would refuse (``end <= begin`` after conversion), as problems.

    Args:
        param_scheduler: The config's ``param_scheduler`` (a dict, a list of dicts, or None).
        samples: Items of the train dataset (packs, when packed).
        batch_size: ``train_dataloader.batch_size``.
        drop_last: ``train_dataloader.drop_last``.

    Returns:
        One message per refused scheduler: which, the integers and the edit.
    """
    length = epoch_length(samples, batch_size, drop_last)
    data = f"{samples} samples, batch size {batch_size}, 1 process"
    return [
        f"{setting}: {problem}\n  -> {edit}"
        for setting, problem, edit in rounding_problems(param_scheduler, length, data)
    ]
