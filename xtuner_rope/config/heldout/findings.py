"""Start-up findings of the held-out evaluation (``TokenLossMetric`` or ``PreferenceMetric``).

The held-out rows get what the train rows get, each dialogue whole and alone; refused before a
weight loads: a missing or empty data file, a ``val_interval`` beyond ``max_iters``, a metric on
a model it cannot serve (``models``).
"""

from __future__ import annotations

from mmengine.config import Config
from mmengine.config.lazy import LazyObject

from xtuner_rope.compat.mmengine_config import config_dict

from ..fields import lazy_get as _get
from ..fields import setter as _setitem
from ..fields import type_name
from ..fields import walk_datasets as _datasets
from ..fields import xtuner_packs as _xtuner_packs
from ..findings import Finding
from ..sequence_parallel import heldout_collate_findings
from ..startup import register_findings
from .files import heldout_file_findings
from .models import (
    SERVED_MODELS,
    TOKEN_METRIC,
    heldout_pairs_findings,
    served_model_findings,
)

CURVES_HOOK = "HeldOutCurvesHook"


def heldout_metrics(cfg: Config) -> list[dict]:
    """The held-out metric dicts (``TokenLossMetric``, ``PreferenceMetric``) of the config's
    ``val_evaluator`` (one or a list)."""
    evaluator = _get(config_dict(cfg), "val_evaluator")
    metrics = _get(evaluator, "metrics", evaluator)
    metrics = metrics if isinstance(metrics, (list, tuple)) else [metrics]
    return [
        m for m in metrics if isinstance(m, dict) and type_name(_get(m, "type")) in SERVED_MODELS
    ]


def _dataset_findings(loader: dict) -> list[Finding]:
    findings = []
    for where, dataset in _datasets(_get(loader, "dataset"), "val_dataloader.dataset"):
        if (
            not _xtuner_packs(dataset)
            or type_name(_get(dataset, "type")) == "heldout_process_hf_dataset"
        ):
            continue

        def fix(dataset=dataset) -> None:
            dataset["type"] = LazyObject(
                "xtuner_rope.data.heldout_dataset", "heldout_process_hf_dataset"
            )
            dataset["use_varlen_attn"] = True
            dataset["shuffle_before_pack"] = False
            # lossless_process_hf_dataset's own argument (the shortcut copies the training
            # dict after the start-up made it one); held-out rows are always whole dialogues
            dataset.pop("whole_dialogues", None)

        findings.append(
            Finding(
                f"{where}.type",
                "XTuner's packing cuts held-out dialogues at row edges and, without "
                "use_varlen_attn, records no boundaries: the held-out loss would not be each "
                "dialogue's loss",
                "set to heldout_process_hf_dataset (same arguments; whole dialogues per row, in "
                "file order, use_varlen_attn=True, shuffle_before_pack=False)",
                fix,
            )
        )
    return findings


def _loader_findings(loader: dict, sp: object = 1) -> list[Finding]:
    findings = []
    packed = any(_xtuner_packs(d) for _, d in _datasets(_get(loader, "dataset"), "x"))
    collate = _get(loader, "collate_fn")
    name = type_name(_get(collate, "type")) if isinstance(collate, dict) else "default_collate_fn"
    if packed and name == "default_collate_fn" and isinstance(sp, int) and sp > 1:
        findings += heldout_collate_findings(loader, sp)
    elif packed and name == "default_collate_fn":
        if _get(loader, "batch_size", 1) != 1:
            findings.append(
                Finding(
                    "val_dataloader.batch_size",
                    "XTuner's default_collate_fn keeps packed rows' boundaries only at "
                    f"batch_size=1, got {_get(loader, 'batch_size')}",
                    "set val_dataloader.batch_size=1, or collate with "
                    "dict(type=rope_collate_fn, max_length=max_length)",
                )
            )
        elif isinstance(collate, dict) and not _get(collate, "use_varlen_attn"):
            findings.append(
                Finding(
                    "val_dataloader.collate_fn.use_varlen_attn",
                    "default_collate_fn drops the packed held-out rows' boundaries",
                    "set to True: it keeps cumulative_len/position_ids (batch size 1)",
                    _setitem(collate, "use_varlen_attn", True),
                )
            )
    elif packed and name != "rope_collate_fn":
        findings.append(
            Finding(
                "val_dataloader.collate_fn",
                f"packed held-out rows: collate function {name} is not known to keep boundaries",
                "use dict(type=default_collate_fn, use_varlen_attn=True) or "
                "dict(type=rope_collate_fn, max_length=max_length)",
            )
        )
    sampler = _get(loader, "sampler")
    kind = type_name(_get(sampler, "type")) if isinstance(sampler, dict) else None
    if kind is None:
        findings.append(
            Finding(
                "val_dataloader.sampler",
                "missing (MMEngine needs one)",
                "set to dict(type=DefaultSampler, shuffle=False)",
                _setitem(loader, "sampler", dict(type="DefaultSampler", shuffle=False)),
            )
        )
    elif kind != "DefaultSampler":
        findings.append(
            Finding(
                "val_dataloader.sampler",
                f"{kind}: TokenLossMetric counts each held-out sample once only in "
                "DefaultSampler's order (MMEngine's collect_results)",
                "use sampler=dict(type=DefaultSampler, shuffle=False)",
            )
        )
    elif _get(sampler, "shuffle", True):
        findings.append(
            Finding(
                "val_dataloader.sampler.shuffle",
                "a shuffled held-out order changes nothing in the loss but the dialogue indices "
                "of the worst-dialogues file",
                "set to False",
                _setitem(sampler, "shuffle", False),
            )
        )
    return findings


def _run_findings(cfg: Config, metric: dict) -> list[Finding]:
    """The metric's model, its tokenizer, ``val_cfg``, ``val_interval`` and the curves hook."""
    findings = served_model_findings(cfg, type_name(_get(metric, "type")))
    tokenizer = _get(config_dict(cfg), "tokenizer")
    token_metric = type_name(_get(metric, "type")) == TOKEN_METRIC  # PreferenceMetric: no words
    if token_metric and _get(metric, "tokenizer") is None and tokenizer is not None:
        findings.append(
            Finding(
                "val_evaluator.tokenizer",
                "not given: the worst-dialogues file would show token ids",
                "set to the config's tokenizer",
                _setitem(metric, "tokenizer", tokenizer),
            )
        )
    if _get(config_dict(cfg), "val_cfg") is None:
        findings.append(
            Finding(
                "val_cfg",
                "missing (MMEngine runs a val_dataloader only with val_cfg)",
                "set to dict(type='ValLoop')",
                _setitem(config_dict(cfg), "val_cfg", dict(type="ValLoop")),
            )
        )
    train_cfg = _get(config_dict(cfg), "train_cfg")
    interval, max_iters = _get(train_cfg, "val_interval", 1), _get(train_cfg, "max_iters")
    if isinstance(max_iters, int) and isinstance(interval, int) and interval > max_iters:
        findings.append(
            Finding(
                "train_cfg.val_interval",
                f"{interval} is beyond the run's max_iters={max_iters}: no held-out evaluation "
                "before the end",
                f"set train_cfg.val_interval to at most {max_iters}",
            )
        )
    findings += _log_findings(cfg, f"{_get(metric, 'name') or 'heldout'}_loss")
    hooks = _get(config_dict(cfg), "custom_hooks") or []
    if all(type_name(_get(h, "type")) != CURVES_HOOK for h in hooks):

        def add() -> None:
            hook = dict(type=LazyObject("xtuner_rope.evaluation.hook", CURVES_HOOK))
            config_dict(cfg).setdefault("custom_hooks", [])
            config_dict(cfg)["custom_hooks"].append(hook)

        findings.append(
            Finding(
                "custom_hooks",
                f"{CURVES_HOOK} missing (held-out checks, worst dialogues, the curves' PNG)",
                f"added dict(type={CURVES_HOOK})",
                add,
            )
        )
    return findings


def _log_findings(cfg: Config, key: str) -> list[Finding]:
    """MMEngine's ``LogProcessor`` logs every key matching ``.*loss.*`` as a mean over its
    last ``window_size`` (10) values, also after a validation: the logged held-out loss would
    be a mean over evaluations. A window of 1 logs each evaluation's own value."""
    processor = _get(config_dict(cfg), "log_processor")
    custom = _get(processor, "custom_cfg") or []
    if any(_get(c, "data_src") == key for c in custom):
        return []

    def fix() -> None:
        if not isinstance(_get(config_dict(cfg), "log_processor"), dict):
            config_dict(cfg)["log_processor"] = dict()
        node = config_dict(cfg)["log_processor"]
        node["custom_cfg"] = list(_get(node, "custom_cfg") or []) + [
            dict(data_src=key, method_name="mean", window_size=1)
        ]

    return [
        Finding(
            "log_processor.custom_cfg",
            f"MMEngine logs {key} (and writes it to scalars.json) as a mean over the last 10 "
            "evaluations, as it smooths every key with 'loss' in its name",
            f"added dict(data_src='{key}', method_name='mean', window_size=1): each evaluation's own value",
            fix,
        )
    ]


def heldout_findings(cfg: Config) -> list[Finding]:
    """Every finding of the held-out entries (also applied by the ``heldout`` shortcut)."""
    loader = _get(config_dict(cfg), "val_dataloader")
    metrics = heldout_metrics(cfg)
    if not isinstance(loader, dict):
        if metrics:
            return [
                Finding(
                    "val_dataloader",
                    f"missing: val_evaluator=dict(type={type_name(_get(metrics[0], 'type'))}) "
                    "has nothing to evaluate",
                    "add val_dataloader (the train dataloader's dict pointed at a held-out "
                    "file) and val_cfg=dict(type=ValLoop)",
                )
            ]
        return []
    sp = _get(config_dict(cfg), "sequence_parallel_size", 1)
    findings = (
        heldout_file_findings(loader) + _dataset_findings(loader) + _loader_findings(loader, sp)
    )
    findings += heldout_pairs_findings(cfg)
    for metric in metrics[:1]:
        findings += _run_findings(cfg, metric)
    return findings


@register_findings("heldout")
def _heldout_findings(cfg: Config) -> list[Finding]:
    return heldout_findings(cfg)
