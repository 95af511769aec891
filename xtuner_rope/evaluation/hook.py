"""``HeldOutCurvesHook``: the held-out evaluation's checks, its files and the curves' picture.

Before training it binds a ``PreferenceMetric`` to the model, refuses a held-out set without
supervised tokens, logs ``heldout_counts`` and points the metric at the work dir; at the end it
draws the training and held-out losses in ``heldout_curves.png``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from mmengine.dist import is_main_process
from mmengine.hooks import Hook
from mmengine.logging import print_log

from xtuner_rope.models.dispatch import unwrap_model

from .heldout_counts import (
    collated_rows,
    document_keys,
    heldout_counts,
    heldout_line,
    overlap_warning,
    row_capacity,
)
from .metric import TokenLossMetric
from .preference_metric import PreferenceMetric

CURVES_FILE = "heldout_curves.png"
# XTuner's label columns: SFT rows, and the two responses of unpacked preference pairs.
LABEL_KEYS = ("labels", "chosen_labels", "rejected_labels")


def heldout_metrics(runner) -> list[TokenLossMetric | PreferenceMetric]:
    """The run's held-out metrics (``Runner.train()`` has built the evaluator)."""
    evaluator = getattr(runner.val_loop, "evaluator", None)
    metrics = getattr(evaluator, "metrics", [])
    return [m for m in metrics if isinstance(m, (TokenLossMetric, PreferenceMetric))]


def supervised_labels(dataset) -> int:
    """Labels other than -100 in ``LABEL_KEYS`` of a held-out dataset (by column; no image)."""
    dataset = getattr(dataset, "text_data", dataset)
    if hasattr(dataset, "column_names"):
        keys = [k for k in LABEL_KEYS if k in dataset.column_names]
        rows = (row for key in keys for row in dataset[key])
    else:
        rows = (sample[k] for sample in dataset for k in LABEL_KEYS if k in sample)
    return sum(sum(1 for label in row if label != -100) for row in rows)


def check_heldout_run(runner) -> None:
    """Refuse a run whose held-out evaluation cannot happen or measure anything.

    Raises:
        ValueError: a held-out set with no row or no supervised token.
    """
    loop = runner.train_loop
    interval, max_iters = getattr(loop, "val_interval", 1), getattr(loop, "max_iters", None)
    if max_iters is not None and interval > max_iters:
        # MMEngine still evaluates once, after the last iteration: say so, do not stop the run
        # (the start-up refuses it where max_iters is in the config itself).
        print_log(
            f"HeldOutCurvesHook: train_cfg.val_interval={interval} is beyond the run's "
            f"{max_iters} iterations: the held-out set is evaluated only after the last one. "
            f"Set train_cfg.val_interval to at most {max_iters} for a curve.",
            logger="current",
            level=logging.WARNING,
        )
    dataset = runner.val_loop.dataloader.dataset
    if len(dataset) == 0 or supervised_labels(dataset) == 0:
        raise ValueError(
            f"HeldOutCurvesHook: the held-out set ({len(dataset)} rows) has no supervised token "
            "(no dialogue, or every label -100): there is no held-out loss to measure. Point "
            "val_dataloader at dialogues with answers."
        )


def log_heldout_counts(runner) -> dict:
    """Log and return ``heldout_counts`` of the run's held-out set (main process)."""
    val = (getattr(runner, "cfg", None) or {}).get("val_dataloader") or {}
    loader = runner.val_loop.dataloader
    capacity = row_capacity(val.get("dataset"), val.get("collate_fn"))
    counts = heldout_counts(
        loader.dataset,
        document_keys(runner.train_dataloader.dataset),
        capacity,
        collated_rows(loader.dataset, loader.collate_fn, loader.batch_size) if capacity else None,
    )
    print_log(f"HeldOutCurvesHook: held-out set {heldout_line(counts)}.", logger="current")
    warning = overlap_warning(counts)
    if warning:
        print_log(f"HeldOutCurvesHook: {warning}.", logger="current", level=logging.WARNING)
    return counts


class HeldOutCurvesHook(Hook):
    """Held-out checks before training; training and held-out loss curves after it (``loss_key``:
    the held-out metric drawn, the metric's ``<name>_loss``)."""

    # After LoggerHook (60) and before CheckpointHook (90): reads what the loops report.
    priority = 75

    def __init__(self, loss_key: str = "heldout_loss") -> None:
        self.loss_key = loss_key
        self.train: list[tuple[int, float]] = []
        self.heldout: list[tuple[int, float]] = []

    def before_train(self, runner) -> None:
        metrics = heldout_metrics(runner)
        if not metrics:
            return
        for metric in metrics:
            if isinstance(metric, PreferenceMetric):
                metric.bind(unwrap_model(runner.model))
            else:
                metric.output_dir = runner.work_dir
        check_heldout_run(runner)
        if is_main_process() and any(isinstance(m, TokenLossMetric) for m in metrics):
            log_heldout_counts(runner)  # dialogues: TokenLossMetric's held-out sets

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if loss is not None:
            self.train.append((runner.iter + 1, float(loss)))

    def after_val_epoch(self, runner, metrics=None) -> None:
        if metrics and self.loss_key in metrics:
            self.heldout.append((runner.iter, float(metrics[self.loss_key])))

    def after_train(self, runner) -> None:
        if not self.heldout or not is_main_process():
            return
        path = Path(runner.work_dir) / CURVES_FILE
        draw_curves(self.train, self.heldout, path)
        print_log(f"HeldOutCurvesHook: training and held-out loss in {path}", logger="current")


def draw_curves(train: list, heldout: list, path: Path) -> None:
    """A PNG at ``path`` of ``train`` and ``heldout``, lists of ``(iteration, loss)``."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="training loss (per iteration)", alpha=0.7)
    ax.plot(*zip(*heldout), "o-", label="held-out loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("next-token NLL")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = [
    "CURVES_FILE",
    "HeldOutCurvesHook",
    "check_heldout_run",
    "draw_curves",
    "heldout_metrics",
    "log_heldout_counts",
    "supervised_labels",
]
