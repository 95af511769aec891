"""The doctor's check of the learning-rate schedule: MMEngine's epoch-to-iteration rounding.

XTuner's stock configs warm up for a ratio of the run (``end=warmup_ratio * max_epochs``,
``convert_to_iter_based=True``). MMEngine turns such a scheduler into an iteration-based one
when the Runner builds it (``build_iter_from_epoch``: ``begin = int(begin * epoch_length)``,
``end = int(end * epoch_length)``, ``epoch_length = len(train_dataloader)``) and the scheduler's
constructor then refuses ``end <= begin`` (``ValueError: end should be larger than begin``). On
a small dataset the warm-up rounds to 0 iterations and ``xtuner train`` stops after the model
has loaded. The doctor knows the dataset's length, so it computes the same integers first.

The plugin's start-up cannot: it runs before the dataset is built, so it does not know
``len(train_dataloader)``; the run itself refuses the same schedulers, with the same message,
right before MMEngine builds them (``xtuner_rope.config.warmup``).
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
        One message per refused scheduler: which, the integers, the dataset's iterations per
        epoch, and the edit (a longer warm-up, ``warmup_ratio`` large enough for one iteration,
        or more data).
    """
    length = epoch_length(samples, batch_size, drop_last)
    data = f"{samples} samples, batch size {batch_size}, 1 process"
    return [
        f"{setting}: {problem}\n  -> {edit}"
        for setting, problem, edit in rounding_problems(param_scheduler, length, data)
    ]
