"""Held-out findings that depend on the model kind: which metric serves it, held-out pairs.

``TokenLossMetric`` serves ``SupervisedFinetune``, ``LLaVAModel`` and ``InternVL_V1_5``;
``PreferenceMetric`` ``DPO``, ``ORPO`` and ``RewardModel``; the other pairing is refused, naming
the metric to use. Held-out pairs get the training pairs' checks and are packed in file order.
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.compat.mmengine_config import config_dict

from ..fields import lazy_get as _get
from ..fields import setter as _setitem
from ..fields import type_name
from ..findings import Finding
from ..preference import PREFERENCE_MODELS, packed_pairs_findings, preference_dataset

TOKEN_METRIC = "TokenLossMetric"
PREFERENCE_METRIC = "PreferenceMetric"
# The metric each model needs (its type name in the config) and where the metric lives.
SERVED_MODELS = {
    TOKEN_METRIC: ("SupervisedFinetune", "LLaVAModel", "InternVL_V1_5"),
    PREFERENCE_METRIC: PREFERENCE_MODELS,
}
METRIC_MODULES = {
    TOKEN_METRIC: "xtuner_rope.evaluation.metric",
    PREFERENCE_METRIC: "xtuner_rope.evaluation.preference_metric",
}


def metric_for(model_type: str | None) -> str:
    """The held-out metric that serves a model type (``TokenLossMetric`` by default)."""
    return PREFERENCE_METRIC if model_type in PREFERENCE_MODELS else TOKEN_METRIC


def served_model_findings(cfg: Config, metric: str) -> list[Finding]:
    """The metric on a model it cannot serve: refused, naming the one that can."""
    model = type_name(_get(_get(config_dict(cfg), "model"), "type"))
    if model in SERVED_MODELS[metric]:
        return []
    what = (
        "scores next-token logits of XTuner's SupervisedFinetune (full, LoRA), LLaVAModel "
        "and InternVL_V1_5"
        if metric == TOKEN_METRIC
        else "scores the pairs of XTuner's DPO, ORPO and RewardModel"
    )
    other = metric_for(model)
    fix = (
        f"use val_evaluator=dict(type={other}) (from xtuner_rope import {other})"
        if other != metric and model in SERVED_MODELS[other]
        else "remove val_evaluator, val_dataloader and val_cfg for this model"
    )
    return [Finding("val_evaluator", f"{metric} {what}; this config's model is {model}", fix)]


def heldout_pairs_findings(cfg: Config) -> list[Finding]:
    """Held-out pairs: the training pairs' checks, and packing in file order."""
    dataset = preference_dataset(cfg, "val_dataloader")
    if dataset is None:
        return []
    findings = packed_pairs_findings(cfg, dataset, "val_dataloader")
    if _get(dataset, "use_varlen_attn") and _get(dataset, "shuffle_before_pack", True):
        findings.append(
            Finding(
                "val_dataloader.dataset.shuffle_before_pack",
                "held-out pairs packed in a random order (numpy's global generator): the "
                "rows, and so the run's log of them, change from run to run",
                "set to False (the loss sums over pairs: the figures do not change)",
                _setitem(dataset, "shuffle_before_pack", False),
            )
        )
    return findings


__all__ = [
    "METRIC_MODULES",
    "PREFERENCE_METRIC",
    "SERVED_MODELS",
    "TOKEN_METRIC",
    "heldout_pairs_findings",
    "metric_for",
    "served_model_findings",
]
