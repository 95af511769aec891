"""The doctor's check of the learning-rate schedule: MMEngine's epoch-to-iteration rounding.

XTuner's stock configs warm up for a ratio of the run (``end=warmup_ratio * max_epochs``,
``convert_to_iter_based=True``). MMEngine turns such a scheduler into an iteration-based one
when the Runner builds it (``build_iter_from_epoch``: ``begin = int(begin * epoch_length)``,
``end = int(end * epoch_length)``, ``epoch_length = len(train_dataloader)``) and the scheduler's
constructor then refuses ``end <= begin`` (``ValueError: end should be larger than begin``). On
a small dataset the warm-up rounds to 0 iterations and ``xtuner train`` stops after the model
has loaded. The doctor knows the dataset's length, so it computes the same integers first.

The plugin's start-up cannot: it runs before the dataset is built, so it does not know
``len(train_dataloader)``.
"""

from __future__ import annotations

INF = 1e9  # MMEngine's INF for an open-ended scheduler


def epoch_length(samples: int, batch_size: int, drop_last: bool = False) -> int:
    """``len(train_dataloader)`` on one process (MMEngine's ``DefaultSampler``, no drop)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def iteration_bounds(scheduler: dict, length: int) -> tuple[int, int] | None:
    """``(begin, end)`` in iterations as MMEngine builds a converted scheduler, else None.

    Args:
        scheduler: One ``param_scheduler`` dict of the config.
        length: ``len(train_dataloader)`` (iterations per epoch).

    Returns:
        None when the scheduler is not converted (``by_epoch=False`` or no
        ``convert_to_iter_based``), or has no ``end`` (MMEngine defaults it to the run's end).
    """
    if not scheduler.get("by_epoch", True) or not scheduler.get("convert_to_iter_based"):
        return None
    end = scheduler.get("end")
    if end is None or end >= INF:
        return None
    return int(scheduler.get("begin", 0) * length), int(end * length)


def schedule_problems(param_scheduler, samples: int, batch_size: int,
                      drop_last: bool = False) -> list[str]:
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
    if not param_scheduler:
        return []
    schedulers = [param_scheduler] if isinstance(param_scheduler, dict) else param_scheduler
    length = epoch_length(samples, batch_size, drop_last)
    problems = []
    for i, scheduler in enumerate(schedulers):
        if not isinstance(scheduler, dict) or length <= 0:
            continue
        bounds = iteration_bounds(scheduler, length)
        if bounds is None or bounds[1] > bounds[0]:
            continue
        begin, end = bounds
        name = getattr(scheduler.get("type"), "__name__", scheduler.get("type"))
        need = 1.0 / length
        problems.append(
            f"param_scheduler[{i}] ({name}, begin={scheduler.get('begin', 0)}, "
            f"end={scheduler.get('end')} epochs, convert_to_iter_based=True) becomes "
            f"begin={begin}, end={end} iterations on this dataset ({samples} samples, batch "
            f"size {batch_size}: {length} iterations per epoch, 1 process): MMEngine refuses it "
            f"when the Runner builds it (ValueError: end should be larger than begin)\n  -> the "
            f"warm-up must last at least 1 iteration: set warmup_ratio so that warmup_ratio * "
            f"max_epochs >= {need:.3g} (or give the scheduler an iteration-based "
            f"end, by_epoch=False; or train on more data)")
    return problems
