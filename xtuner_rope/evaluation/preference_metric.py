"""``PreferenceMetric``: held-out loss, preference accuracy and reward margin of DPO, ORPO and
reward models, each pair whole and alone, exact on any rank count.

Each pair's loss is the model's loss of a batch holding that pair alone
(:mod:`xtuner_rope.ops.preference_loss`); the held-out loss sums pairs / pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from mmengine.evaluator import BaseMetric

from xtuner_rope.models import channel
from xtuner_rope.ops.preference_loss import (
    DPO_PAIR_LOSSES,
    dpo_pair_losses,
    orpo_pair_losses,
    reward_pair_losses,
)
from xtuner_rope.ops.token_nll import IGNORE_INDEX, document_nll

from .metric import row_bounds, row_scores

MODEL_KINDS = {"DPO": "dpo", "ORPO": "orpo", "RewardModel": "reward"}
_PREFIXES = {"dpo": ("", "ref_")}  # of a row's logits by kind: DPO's reference's too; else ("",)


def preference_kind(model: object) -> str | None:
    """'dpo', 'orpo' or 'reward' for XTuner's preference models (subclasses too), else None."""
    return next(
        (MODEL_KINDS[c.__name__] for c in type(model).__mro__ if c.__name__ in MODEL_KINDS), None
    )


def _responses(data: dict, b: int, s: int) -> list[list[tuple[int, int]]]:
    """Per row, each response's ``(start, end)``: at the published boundaries (an odd trailing
    pad segment dropped), else the row up to its ``attention_mask`` length."""
    flat = channel.read()[0]
    if flat is None:
        mask = data.get("attention_mask")
        lengths = mask.sum(-1).tolist() if isinstance(mask, torch.Tensor) else [s] * b
        return [[(0, int(n))] for n in lengths]
    rows = [list(zip(x[:-1].tolist(), x[1:].tolist())) for x in row_bounds(flat, b, s)]
    return [spans[: len(spans) // 2 * 2] for spans in rows]


class PreferenceMetric(BaseMetric):
    """Held-out loss, preference accuracy and reward margin of XTuner's DPO, ORPO, reward model:
    ``<name>_loss``, ``_accuracy`` (chosen reward above rejected), ``_margin`` (mean chosen minus
    rejected reward) and ``_pairs``."""

    default_prefix = None

    def __init__(self, name: str = "heldout", collect_device: str = "cpu") -> None:
        super().__init__(collect_device=collect_device, prefix="")  # keys carry `name`
        self.name = name
        self.kind: str | None = None
        self.settings: dict = {}

    def bind(self, model: object) -> None:
        """Read the unwrapped model's kind and loss settings (``HeldOutCurvesHook`` calls this).

        Raises:
            TypeError: another model (SFT: use ``TokenLossMetric``).
            ValueError: a DPO loss type without a per-pair loss (``kto_pair``).
        """
        kind = preference_kind(model)
        if kind is None:
            raise TypeError(
                f"PreferenceMetric serves XTuner's DPO, ORPO and RewardModel; this run's model "
                f"is {type(model).__name__}. Use val_evaluator=dict(type=TokenLossMetric) for "
                "SFT models."
            )
        if kind == "dpo" and model.loss_type not in DPO_PAIR_LOSSES:
            raise ValueError(
                f"PreferenceMetric: DPO loss_type={model.loss_type!r} has no loss per pair "
                "(kto_pair estimates its KL terms over the batch); a held-out loss needs one of "
                f"{', '.join(DPO_PAIR_LOSSES)}. Remove val_evaluator or change dpo_loss_type."
            )
        names = {
            "dpo": ("beta", "loss_type", "label_smoothing"),
            "orpo": ("beta",),
            "reward": ("loss_type", "penalty_type", "penalty_weight"),
        }[kind]
        self.kind, self.settings = kind, {k: getattr(model, k) for k in names}

    def _response_values(self, out: dict, labels: torch.Tensor, spans: list) -> list[dict]:
        """Per response of one row: its summed log-prob(s) and targets, or its reward score."""
        if self.kind == "reward":  # one reward token (label 0 or 1) per response, in order
            scores = out["logits"].reshape(labels.shape[0], -1)[:, 0]  # [s]
            at = torch.nonzero(labels != IGNORE_INDEX)[:, 0].tolist()
            return [{"score": float(scores[t])} for t in at]
        if not spans:
            return []
        bounds = torch.tensor([0] + [e for _, e in spans])  # [n + 1]: responses back to back
        prefixes = _PREFIXES.get(self.kind, ("",))
        sums = {p: document_nll(row_scores(out, p), labels, bounds) for p in prefixes}
        return [
            {
                "logp": -float(sums[""][0][i]),
                "ref_logp": -float(sums["ref_"][0][i]) if self.kind == "dpo" else None,
                "tokens": int(sums[""][1][i]),
            }
            for i in range(len(spans))
        ]

    def process(self, data_batch: dict, data_samples: Sequence[dict]) -> None:
        """Score each response; one result (its pairs) per dataset sample.

        Args:
            data_batch: The collated batch; ``data`` holds ``labels`` ``[b, s]``.
            data_samples: ``b`` dicts with ``logits`` ``[s, V]`` or chunked ``target_logprobs``
                ``[s]`` (DPO also ``ref_``-prefixed; reward ``logits`` ``[s, 1]``).

        Raises:
            RuntimeError: the metric was not bound to the model.
            TypeError: ``val_step`` did not return what the model kind gives.
            ValueError: an odd number of rows without boundaries (packed pairs unbounded).
        """
        if self.kind is None:
            raise RuntimeError(
                "PreferenceMetric: not bound to the run's model; HeldOutCurvesHook binds it "
                "before training (the start-up adds it: keep model_resource=dict("
                "fn=enable_xtuner_rope), or add dict(type=HeldOutCurvesHook) to custom_hooks)."
            )
        data = data_batch["data"]
        labels = data["labels"]
        b, s = labels.shape
        if channel.read()[0] is None and b % 2:
            raise ValueError(
                f"PreferenceMetric: a held-out batch of {b} row(s) without response boundaries: "
                "unpacked pairs come as two rows each (chosen, rejected), packed pairs need "
                "their cumulative_len (keep use_varlen_attn the same on the model, the dataset "
                "and preference_collate_fn, and PackedBatchCheckHook in custom_hooks)."
            )
        prefixes = _PREFIXES.get(self.kind, ("",))
        if len(data_samples) != b or not all(
            all(row_scores(x, p) is not None for p in prefixes) for x in data_samples
        ):
            raise TypeError(
                f"PreferenceMetric ({self.kind}): model.val_step must return one dict with "
                f"{' and '.join(p + 'logits' for p in prefixes)} per row ({b} rows), got "
                f"{[sorted(x) if isinstance(x, dict) else type(x).__name__ for x in data_samples]}."
            )
        rows = [
            self._response_values(out, labels[r].to(row_scores(out).device), spans)
            for r, (out, spans) in enumerate(zip(data_samples, _responses(data, b, s)))
        ]
        if channel.read()[0] is None:  # unpacked: rows 2i, 2i + 1 are one pair (one sample)
            rows = [rows[i] + rows[i + 1] for i in range(0, b - 1, 2)]
        for responses in rows:
            self.results.append({"pairs": list(zip(responses[::2], responses[1::2]))})

    def _pair_values(self, pairs: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def column(key: str, side: int, average: bool = False) -> torch.Tensor:
            values = [pair[side][key] / (pair[side]["tokens"] if average else 1) for pair in pairs]
            return torch.tensor(values, dtype=torch.float64)

        if self.kind == "dpo":
            average = self.settings["loss_type"] == "ipo"  # XTuner averages for IPO only
            return dpo_pair_losses(
                column("logp", 0, average),
                column("logp", 1, average),
                column("ref_logp", 0, average),
                column("ref_logp", 1, average),
                **self.settings,
            )
        if self.kind == "orpo":
            return orpo_pair_losses(
                column("logp", 0, True), column("logp", 1, True), **self.settings
            )
        return reward_pair_losses(column("score", 0), column("score", 1), **self.settings)

    def compute_metrics(self, results: list) -> dict:
        """Totals over the held-out pairs (results in dataset order, repeats already cut).

        Raises:
            ValueError: the held-out set has no pair.
        """
        pairs = [pair for result in results for pair in result["pairs"]]
        if not pairs:
            raise ValueError(
                f"PreferenceMetric: the held-out set ({len(results)} rows) has no pair: there "
                "is no held-out loss to measure. Point val_dataloader at a file of pairs."
            )
        loss, chosen, rejected = self._pair_values(pairs)
        return {
            f"{self.name}_loss": math.fsum(loss.tolist()) / len(pairs),
            f"{self.name}_accuracy": float((chosen > rejected).double().mean()),
            f"{self.name}_margin": math.fsum((chosen - rejected).tolist()) / len(pairs),
            f"{self.name}_pairs": len(pairs),
        }


__all__ = ["MODEL_KINDS", "PreferenceMetric", "preference_kind"]
