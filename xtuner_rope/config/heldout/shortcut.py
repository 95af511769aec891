"""The held-out shortcut: ``heldout = dict(...)`` in PART 1 derives MMEngine's held-out entries.

``data_files=`` evaluates another file in the training format; ``fraction=0.05`` holds out the
last 5% of each training file; ``interval`` sets ``val_interval``. The start-up writes
``val_dataloader``, ``val_evaluator`` and ``val_cfg``, then applies ``config.heldout.findings``.
LLaVA and InternVL configs take ``data_files`` only.
"""

from __future__ import annotations

import copy
from pathlib import Path

from mmengine.config import Config
from mmengine.config.lazy import LazyObject

from xtuner_rope.compat.mmengine_config import config_dict

from ..fields import lazy_get as _get
from ..fields import type_name
from ..fields import walk_datasets as _datasets
from ..findings import ConfigConflict, Finding, conflict_message
from ..startup import register_findings
from .models import METRIC_MODULES, metric_for

KEY = "heldout"


def _loaders(loader: dict) -> list[dict]:
    """The ``load_dataset`` dicts below a dataloader (``process_hf_dataset``'s ``dataset``)."""
    return [
        d
        for _, d in _datasets(_get(loader, "dataset"), "x")
        if type_name(_get(d, "type")) == "load_dataset"
    ]


# Image datasets and the field naming their data file (one file, or a list of files).
IMAGE_DATASETS = {"LLaVADataset": "data_path", "InternVL_V1_5_Dataset": "data_paths"}


def _image_datasets(loader: dict) -> list[dict]:
    """The LLaVA / InternVL dataset dicts below a dataloader."""
    return [
        d
        for _, d in _datasets(_get(loader, "dataset"), "x")
        if type_name(_get(d, "type")) in IMAGE_DATASETS
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
    if isinstance(loader, dict) and _image_datasets(loader):
        if fraction is not None:
            return (
                "fraction needs datasets' split slicing (load_dataset); this config's "
                f"{type_name(_get(_image_datasets(loader)[0], 'type'))} reads its file itself: "
                "give the held-out samples as dict(data_files=PATH)"
            )
        if not isinstance(spec["data_files"], (str, Path)):
            return f"data_files must be one file for an image dataset, got {spec['data_files']!r}"
        return None
    if "image_folder" in spec:
        return "image_folder is for LLaVA / InternVL datasets; this config's data has no images"
    if not isinstance(loader, dict) or not _loaders(loader):
        return "train_dataloader has no load_dataset(...) dict to derive the held-out data from"
    return None


def _metric(cfg: Config) -> str:
    """The held-out metric of the config's model (``models.metric_for``)."""
    return metric_for(type_name(_get(_get(config_dict(cfg), "model"), "type")))


def _derive(cfg: Config, spec: dict) -> None:
    """Write the held-out entries, then apply the held-out findings to them."""
    from .findings import heldout_findings

    train = config_dict(cfg)["train_dataloader"]
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
        for node in _image_datasets(val):
            key = IMAGE_DATASETS[type_name(_get(node, "type"))]
            node[key] = (
                [str(spec["data_files"])] if key == "data_paths" else str(spec["data_files"])
            )
            folder = spec.get("image_folder")
            if key == "data_paths":  # one image folder per data file (default: the training one)
                folders = _get(node, "image_folders")
                folders = folders[0] if isinstance(folders, (list, tuple)) else folders
                node["image_folders"] = [str(folder) if folder else folders]
                node["repeat_times"] = [1]
            elif folder:
                node["image_folder"] = str(folder)
            node.pop("offline_processed_text_folder", None)  # it would win over data_path
    val["sampler"] = dict(type="DefaultSampler", shuffle=False)
    config_dict(cfg)["val_dataloader"] = val
    metric = _metric(cfg)
    config_dict(cfg)["val_evaluator"] = dict(type=LazyObject(METRIC_MODULES[metric], metric))
    config_dict(cfg)["val_cfg"] = dict(type="ValLoop")
    if spec.get("interval"):
        config_dict(cfg)["train_cfg"]["val_interval"] = spec["interval"]
    findings = heldout_findings(cfg)
    conflicts = [f for f in findings if f.fix is None]
    if conflicts:
        raise ConfigConflict(conflict_message(conflicts))
    for finding in findings:
        finding.fix()
    spec["derived"] = True


@register_findings("heldout")
def _shortcut_findings(cfg: Config) -> list[Finding]:
    spec = _get(config_dict(cfg), KEY)
    if spec is None or _get(spec, "derived"):  # derived already: the re-check sees its result
        return []
    problem = _problem(spec, _get(config_dict(cfg), "train_dataloader"))
    if problem:
        return [Finding(KEY, problem, "set heldout = dict(fraction=0.05) or dict(data_files=PATH)")]
    if _get(config_dict(cfg), "val_dataloader") is not None:
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
