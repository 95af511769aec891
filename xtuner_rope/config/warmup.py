"""A warm-up that rounds to 0 iterations: MMEngine's epoch-to-iteration conversion, named.

MMEngine converts ``end=warmup_ratio * max_epochs`` with ``int(end * len(train_dataloader))``
(3% of a 30-iteration epoch is 0: the scheduler dies). Refused with the setting, the length and
the edit by the doctor and, in ``xtuner train``, before the schedulers are built
(``refuse_rounded_warmup``, in ``compat.mmengine_scheduler.SCHEDULER_CHECKS``).
"""

from __future__ import annotations

from collections.abc import Iterable

from xtuner_rope.compat.mmengine_scheduler import SCHEDULER_CHECKS

from .findings import ConfigConflict, Finding, conflict_message

INF = 1e9  # MMEngine's INF for an open-ended scheduler


def epoch_length(samples: int, batch_size: int, drop_last: bool = False) -> int:
    """``len(train_dataloader)`` on one process (MMEngine's ``DefaultSampler``, no drop)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def iteration_bounds(scheduler: dict, length: int) -> tuple[int, int] | None:
    """``(begin, end)`` in iterations as MMEngine builds a converted ``scheduler`` with ``length``
    iterations per epoch; None when it is not converted, or has no ``end``.
    """
    if not scheduler.get("by_epoch", True) or not scheduler.get("convert_to_iter_based"):
        return None
    end = scheduler.get("end")
    if end is None or end >= INF:
        return None
    return int(scheduler.get("begin", 0) * length), int(end * length)


def _type_name(value: object) -> str:
    return str(getattr(value, "__name__", value))


def rounding_problems(schedulers: object, length: int, data: str) -> list[tuple[str, str, str]]:
    """``(setting, problem, edit)`` of each scheduler MMEngine would refuse once converted
    (``end <= begin``): ``schedulers`` the config's ``param_scheduler`` (dict, list or None),
    ``length`` iterations per epoch, ``data`` how that length came about (for the message).
    """
    if not schedulers or length <= 0:
        return []
    items = [schedulers] if isinstance(schedulers, dict) else list(schedulers)
    found = []
    for i, scheduler in enumerate(items):
        if not isinstance(scheduler, dict):
            continue
        bounds = iteration_bounds(scheduler, length)
        if bounds is None or bounds[1] > bounds[0]:
            continue
        begin, end = bounds
        found.append(
            (
                f"param_scheduler[{i}]",
                f"{_type_name(scheduler.get('type'))}, begin={scheduler.get('begin', 0)}, "
                f"end={scheduler.get('end')} epochs, convert_to_iter_based=True, becomes "
                f"begin={begin}, end={end} iterations on this dataset ({data}: {length} iterations "
                f"per epoch): MMEngine refuses it when the Runner builds it (ValueError: end should "
                f"be larger than begin)",
                f"the warm-up must last at least 1 iteration: set warmup_ratio so that "
                f"warmup_ratio * max_epochs >= {1.0 / length:.3g} (or give the scheduler an "
                f"iteration-based end, by_epoch=False; or train on more data)",
            )
        )
    return found


def refuse_rounded_warmup(schedulers: Iterable, length: int, data: str) -> None:
    """Raise ``ConfigConflict`` naming each scheduler MMEngine would refuse, the iterations per
    epoch and the edit.
    """
    problems = rounding_problems(schedulers, length, data)
    if problems:
        raise ConfigConflict(conflict_message([Finding(*p) for p in problems]))


# MMEngine's scheduler build runs it (mmengine_scheduler.patch_mmengine_warmup_rounding): compat sits below
# the start-up, so the check is handed down when this module is imported (at activation).
if refuse_rounded_warmup not in SCHEDULER_CHECKS:
    SCHEDULER_CHECKS.append(refuse_rounded_warmup)
