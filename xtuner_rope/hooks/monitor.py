"""MMEngine hooks that watch training: :class:`PackingMetricsHook` (the figures of
:mod:`xtuner_rope.batch.stats` in every log line) and :class:`NonFiniteTripwireHook` (the run
stopped at the first non-finite loss or gradient norm, the batch and weights saved for
``tools/replay_batch.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
from mmengine.dist import get_rank
from mmengine.hooks import Hook, LoggerHook

from xtuner_rope.batch.record import save_record
from xtuner_rope.batch.stats import BatchStats, batch_stats
from xtuner_rope.models import channel
from xtuner_rope.models.dispatch import isolates_documents, unwrap_model
from xtuner_rope.ops.packing import cumulative_from_position_ids

DATA_BATCH = Optional[Union[dict, tuple, list]]

# Log names (``train/<name>`` in the MessageHub): figure of a window of iterations.
METRICS = {
    "docs_per_row": lambda w, total: w.documents / max(w.rows, 1),
    "real_token_share": lambda w, total: w.real_tokens / max(w.tokens, 1),
    "longest_doc": lambda w, total: w.longest_document,
    "max_position_id": lambda w, total: w.max_position,
    "unsupervised_seen": lambda w, total: total,
}
# XTuner's preference models (their rows hold chosen/rejected pairs): pairs_per_row is logged.
PAIR_MODELS = ("DPO", "ORPO", "RewardModel")


class PackingMetricsHook(Hook):
    """Log documents per row (``pairs_per_row`` for preference models), real-token share, longest
    document, largest position id and unsupervised documents, per logging window, as
    ``train/<name>`` scalars of ``runner.message_hub``.

    Args:
        window: iterations per window; default: the LoggerHook's interval.
        pad_index: the id the collator pads ``input_ids`` with (``rope_collate_fn``'s).
    """

    # After PackedBatchCheckHook (8): figures of batches that passed its checks. It reads the
    # boundaries from position_ids, so it does not need the cumulative_len that hook pops.
    priority = 9

    def __init__(self, window: int | None = None, pad_index: int = 0) -> None:
        self.window = window
        self.pad_index = pad_index
        self._stats = BatchStats()
        self._unsupervised = 0
        self._pairs = False

    def before_train(self, runner) -> None:
        # XTuner's DPO / ORPO / RewardModel: each pair is two documents (chosen, rejected)
        model_classes = type(unwrap_model(runner.model)).__mro__
        self._pairs = any(c.__name__ in PAIR_MODELS for c in model_classes)
        if self.window is None:
            loggers = [h for h in runner.hooks if isinstance(h, LoggerHook)]
            self.window = loggers[0].interval if loggers else 10
        seen = runner.message_hub.log_scalars.get("train/unsupervised_seen")
        self._unsupervised = int(seen.current()) if seen is not None else 0

    def before_train_iter(self, runner, batch_idx: int, data_batch: DATA_BATCH = None) -> None:
        if not isinstance(data_batch, dict) or not isinstance(data_batch.get("data"), dict):
            return
        stats = batch_stats(data_batch["data"], pad_index=self.pad_index)
        if runner.iter % self.window == 0:
            self._stats = BatchStats()
        self._stats = self._stats + stats
        self._unsupervised += stats.unsupervised_documents
        for name, figure in METRICS.items():
            runner.message_hub.update_scalar(
                f"train/{name}", float(figure(self._stats, self._unsupervised))
            )
        if self._pairs:
            runner.message_hub.update_scalar(
                "train/pairs_per_row", self._stats.documents / 2 / max(self._stats.rows, 1)
            )


class NonFiniteError(RuntimeError):
    """Training produced a NaN or inf loss or gradient norm; the batch was saved for replay."""


def _optimizers(runner) -> list:
    wrapper = getattr(runner, "optim_wrapper", None)
    wrappers = getattr(wrapper, "optim_wrappers", None)
    found = list(wrappers.values()) if isinstance(wrappers, dict) else [wrapper]
    return [
        w.optimizer
        for w in found
        if w is not None and hasattr(getattr(w, "optimizer", None), "register_step_pre_hook")
    ]


def _grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


class NonFiniteTripwireHook(Hook):
    """Stop training at the first non-finite loss or gradient norm, before the weights change.

    Checked right before ``optimizer.step`` (one device sync a step), else in
    ``after_train_iter`` (DeepSpeed). On failure it writes ``<work_dir>/nonfinite_iter<k>.pt``
    (the batch, for :mod:`xtuner_rope.outputs.replay`) and ``nonfinite_iter<k>_weights.pt``
    (not with ``save_weights=False``: replay then needs ``--checkpoint``), then raises
    :class:`NonFiniteError` naming both and the replay command.
    """

    # Before RuntimeInfoHook (10) logs the iteration's loss; after PackedBatchCheckHook (8).
    priority = 9

    def __init__(self, save_weights: bool = True) -> None:
        self.save_weights = save_weights
        self._handles: list = []
        self._batch: dict | None = None
        self._losses: list[torch.Tensor] = []
        self._checked = False

    def before_train(self, runner) -> None:
        self._runner = runner
        model = unwrap_model(runner.model)
        self._handles = [model.register_forward_hook(self._collect_losses)]
        self._handles += [
            opt.register_step_pre_hook(self._before_step) for opt in _optimizers(runner)
        ]
        self._steps_checked = bool(self._handles[1:])

    def after_train(self, runner) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def before_train_iter(self, runner, batch_idx: int, data_batch: DATA_BATCH = None) -> None:
        data = data_batch.get("data") if isinstance(data_batch, dict) else None
        self._batch = dict(data) if isinstance(data, dict) else None
        self._batch_idx = batch_idx
        self._losses, self._checked = [], False

    def _collect_losses(self, module, args, output) -> None:
        if module.training and isinstance(output, dict):
            self._losses += [
                v.detach() for k, v in output.items() if "loss" in k and isinstance(v, torch.Tensor)
            ]

    def _before_step(self, optimizer, args, kwargs) -> None:
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        norm = _grad_norm(grads) if grads else None
        losses = [loss.float().sum().reshape(1) for loss in self._losses]
        values = torch.cat(
            losses
            + (
                []
                if norm is None
                else [norm.float().reshape(1).to(losses[0].device if losses else norm.device)]
            )
        )
        values = values.tolist()  # the one sync of the check
        self._checked = True
        for name, value in zip(["loss"] * len(losses) + ["grad_norm"], values):
            if value != value or value in (float("inf"), float("-inf")):
                self._trip(self._runner, name, value, stepped=False, optimizer=optimizer)

    def after_train_iter(
        self, runner, batch_idx: int, data_batch: DATA_BATCH = None, outputs: Optional[dict] = None
    ) -> None:
        if self._checked or not isinstance(outputs, dict):
            return
        loss = outputs.get("loss")
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss).all()):
            # Without step hooks (DeepSpeed) the optimizer may already have applied it.
            self._trip(runner, "loss", float(loss.float().sum()), stepped=not self._steps_checked)

    def _trip(self, runner, quantity: str, value: float, stepped: bool, optimizer=None) -> None:
        k = runner.iter + 1  # as the log line counts
        work_dir = Path(runner.work_dir)
        weights = work_dir / f"nonfinite_iter{k}_weights.pt"
        model = unwrap_model(runner.model)
        if self.save_weights:
            torch.save({n: t.detach().cpu() for n, t in model.state_dict().items()}, weights)
        path = save_record(
            work_dir / f"nonfinite_iter{k}.pt",
            self._record(
                runner,
                k,
                quantity,
                value,
                stepped,
                str(weights) if self.save_weights else None,
                optimizer,
            ),
        )
        config = getattr(runner.cfg, "filename", None) or "<your config>"
        raise NonFiniteError(
            f"NonFiniteTripwireHook: iteration {k}: non-finite {quantity} ({value}); training "
            f"stopped {'after' if stepped else 'before'} the optimizer step. The batch is saved "
            f"in {path}"
            + (f" and the weights it ran with in {weights}" if self.save_weights else "")
            + f". Find the first layer and document that produced it with:\n"
            f"    python tools/replay_batch.py {path} --config {config}"
        )

    def _record(
        self,
        runner,
        k: int,
        quantity: str,
        value: float,
        stepped: bool,
        weights: str | None,
        optimizer,
    ) -> dict:
        """Everything the replay needs: batch, boundaries, attention arguments, provenance."""
        data = {
            n: t.detach().cpu()
            for n, t in (self._batch or {}).items()
            if isinstance(t, torch.Tensor)
        }
        b, s = data["input_ids"].shape
        rows = data.get("position_ids", torch.arange(s).expand(b, s))  # none: one doc per row
        cumulative, max_seqlen = channel.read()
        bad_grads = []
        if optimizer is not None:
            names = {p: n for n, p in runner.model.named_parameters()}
            bad_grads = [
                names.get(p, "?")
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ]
        last = Path(runner.work_dir) / "last_checkpoint"
        return {
            "iteration": k,
            "batch_idx": self._batch_idx,
            "epoch": runner.epoch,
            "seed": runner.seed,
            "rank": get_rank(),
            "quantity": quantity,
            "value": value,
            "stepped": stepped,
            "data": data,
            "boundaries": [cumulative_from_position_ids(r) for r in rows],
            "varlen": {
                "cumulative_len": None if cumulative is None else cumulative.cpu(),
                "max_seqlen": max_seqlen,
            },
            "isolating": isolates_documents(runner.model),
            "nonfinite_grads": bad_grads[:20],
            "config": str(getattr(runner.cfg, "filename", "") or ""),
            "weights": weights,
            "last_checkpoint": last.read_text().strip() if last.is_file() else None,
        }
