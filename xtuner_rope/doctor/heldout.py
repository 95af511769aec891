"""The doctor's held-out figures: ``val_dataloader``'s set as ``HeldOutCurvesHook`` logs it."""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.config.fields import type_name
from xtuner_rope.config.heldout import heldout_metrics
from xtuner_rope.config.heldout.models import TOKEN_METRIC
from xtuner_rope.evaluation.heldout_counts import (
    collated_rows,
    document_keys,
    heldout_counts,
    heldout_line,
    overlap_warning,
    row_capacity,
)


def heldout_report(cfg: Config, dataset, refused: bool, collate_builder) -> dict | None:
    """The held-out figures of a started config against its built training ``dataset``, or None
    without ``TokenLossMetric``; ``{'refused': True}`` (nothing built) where the start-up refuses.
    """
    from xtuner.registry import BUILDER

    loader = cfg.get("val_dataloader")
    token_metric = any(type_name(m.get("type")) == TOKEN_METRIC for m in heldout_metrics(cfg))
    if not token_metric or not isinstance(loader, dict):  # PreferenceMetric: pairs, not dialogues
        return None
    if refused:
        return {"refused": True}
    heldout = BUILDER.build(loader["dataset"])
    capacity = row_capacity(loader["dataset"], loader.get("collate_fn"))
    rows = None
    if capacity:
        collate = collate_builder(loader)[0]
        rows = collated_rows(heldout, collate, int(loader.get("batch_size", 1)))
    return heldout_counts(heldout, document_keys(dataset), capacity, rows)


def heldout_lines(figures: dict | None) -> list[str]:
    """The summary's held-out line."""
    if not figures:
        return []
    if figures.get("refused"):
        return ["held-out     not built: the start-up refuses the config (see the conflicts)"]
    return [f"held-out     {heldout_line(figures)}"]


def heldout_warnings(figures: dict | None) -> list[str]:
    """A held-out set that shares dialogues with the training data."""
    warning = overlap_warning(figures) if figures else None
    return [warning] if warning else []


__all__ = ["heldout_lines", "heldout_report", "heldout_warnings"]
