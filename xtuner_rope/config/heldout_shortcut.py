"""The held-out shortcut: ``heldout = dict(...)`` in PART 1 derives MMEngine's held-out entries.

``heldout = dict(data_files="held.jsonl")`` evaluates another file in the training data's
format; ``heldout = dict(fraction=0.05)`` holds out the last 5% of each training file
(``datasets``' split slicing ``train[95%:]``, training keeps ``train[:95%]``: deterministic, no
dialogue in both). Optional ``interval`` sets ``train_cfg.val_interval``. The start-up writes
``val_dataloader`` (a copy of the training one, on the held-out data, unshuffled),
``val_evaluator`` (``TokenLossMetric`` for SFT models, ``PreferenceMetric`` for DPO, ORPO and
reward models) and ``val_cfg = dict(type='ValLoop')``, then
applies the held-out findings of :mod:`xtuner_rope.config.heldout` to them.
"""

from __future__ import annotations

import copy

from mmengine.config import Config
from mmengine.config.lazy import LazyObject

from .fields import lazy_get as _get
from .fields import type_name
from .fields import walk_datasets as _datasets
from .findings import ConfigConflict, conflict_message
from .heldout_pairs import METRIC_MODULES, metric_for
from .startup import Finding, register_findings

KEY = "heldout"


def _loaders(loader: dict) -> list[dict]:
    """The ``load_dataset`` dicts below a dataloader (``process_hf_dataset``'s ``dataset``)."""
    return [
        d
        for _, d in _datasets(_get(loader, "dataset"), "x")
        if type_name(_get(d, "type")) == "load_dataset"
    ]


def _problem(spec: object, loader: object) -> str | None:
    if not isinstance(spec, dict) or len({"data_files", "fraction"} & set(spec)) != 1:
        return f"expected dict(data_files=PATH) or dict(fraction=F), got {spec!r}"
    fraction = spec.get("fraction")
    if fraction is not None and not (
        isinstance(fraction, float)
        and 0 < fraction < 1
        and abs(fraction * 100 - round(fraction * 100)) < 1e-9
    ):
        return f"fraction must be a float in (0, 1) in whole percents (0.05), got {fraction!r}"
    if not isinstance(loader, dict) or not _loaders(loader):
        return "train_dataloader has no load_dataset(...) dict to derive the held-out data from"
    return None


def _metric(cfg: Config) -> str:
    """The held-out metric of the config's model (``heldout_pairs.metric_for``)."""
    return metric_for(type_name(_get(_get(cfg._cfg_dict, "model"), "type")))


def _derive(cfg: Config, spec: dict) -> None:
    """Write the held-out entries, then apply the held-out findings to them."""
    from .heldout import heldout_findings

    train = cfg._cfg_dict["train_dataloader"]
    val = copy.deepcopy(train)
    if "fraction" in spec:
        cut = round(100 - spec["fraction"] * 100)
        for node in _loaders(train):
            node["split"] = f"train[:{cut}%]"
        for node in _loaders(val):
            node["split"] = f"train[{cut}%:]"
    else:
        for node in _loaders(val):
            node["path"] = "json"
            node["data_files"] = dict(train=spec["data_files"])
    val["sampler"] = dict(type="DefaultSampler", shuffle=False)
    cfg._cfg_dict["val_dataloader"] = val
    metric = _metric(cfg)
    cfg._cfg_dict["val_evaluator"] = dict(type=LazyObject(METRIC_MODULES[metric], metric))
    cfg._cfg_dict["val_cfg"] = dict(type="ValLoop")
    if spec.get("interval"):
        cfg._cfg_dict["train_cfg"]["val_interval"] = spec["interval"]
    findings = heldout_findings(cfg)
    conflicts = [f for f in findings if f.fix is None]
    if conflicts:
        raise ConfigConflict(conflict_message(conflicts))
    for finding in findings:
        finding.fix()
    spec["derived"] = True


@register_findings("heldout")
def _shortcut_findings(cfg: Config) -> list[Finding]:
    spec = _get(cfg._cfg_dict, KEY)
    if spec is None or _get(spec, "derived"):  # derived already: the re-check sees its result
        return []
    problem = _problem(spec, _get(cfg._cfg_dict, "train_dataloader"))
    if problem:
        return [Finding(KEY, problem, "set heldout = dict(fraction=0.05) or dict(data_files=PATH)")]
    if _get(cfg._cfg_dict, "val_dataloader") is not None:
        return [Finding(KEY, "given with val_dataloader", "keep one of them")]
    what = (
        f"the last {spec['fraction']:.0%} of each training file held out (split slicing)"
        if "fraction" in spec
        else f"{spec['data_files']} evaluated"
    )
    return [
        Finding(
            KEY,
            what,
            "wrote val_dataloader (the training one on the held-out data), "
            f"val_evaluator=dict(type={_metric(cfg)}), val_cfg=dict(type='ValLoop')",
            lambda: _derive(cfg, spec),
        )
    ]
