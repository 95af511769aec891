"""Start-up findings of packing: XTuner's packs record their boundaries, keep them through the
collate function, drop nothing; the stock ``use_varlen_attn`` switch is served by the plugin.

Offline packs go through ``lossless_process_hf_dataset`` (``offline_packing = "cut"``: XTuner's
cut); docs/turning-it-on.md lists each fix, the stock ``use_varlen_attn = True`` among them.
"""

from __future__ import annotations

from mmengine.config import Config
from mmengine.config.lazy import LazyObject

from xtuner_rope.compat.mmengine_config import config_dict

from .fields import lazy_get as _get
from .fields import offline_packs as _offline_packs
from .fields import setter as _setitem
from .fields import type_name
from .fields import walk_datasets as _datasets
from .fields import xtuner_packs as _xtuner_packs
from .findings import Finding
from .startup import register_findings


def _packing_findings(loader: dict) -> list[Finding]:
    """XTuner's offline packing: boundaries must be recorded and survive the collate function."""
    findings, packed = [], False
    for where, dataset in _datasets(_get(loader, "dataset"), "train_dataloader.dataset"):
        packed = packed or _xtuner_packs(dataset) or _offline_packs(dataset)
        if _xtuner_packs(dataset) and not _get(dataset, "use_varlen_attn"):
            findings.append(
                Finding(
                    f"{where}.use_varlen_attn",
                    "process_hf_dataset(pack_to_max_length=True) joins "
                    "dialogues without recording where each starts: documents would attend to each "
                    "other",
                    "set to True: XTuner's Packer records the boundaries (same packs)",
                    _setitem(dataset, "use_varlen_attn", True),
                )
            )
    collate = _get(loader, "collate_fn")
    name = type_name(_get(collate, "type")) if isinstance(collate, dict) else "default_collate_fn"
    batch_size = _get(loader, "batch_size", 1)
    if not packed or name == "rope_collate_fn":
        return findings
    if name == "default_collate_fn" and batch_size == 1:
        if not _get(collate, "use_varlen_attn"):
            findings.append(
                Finding(
                    "train_dataloader.collate_fn.use_varlen_attn",
                    "default_collate_fn drops the packed rows' boundaries",
                    "set to True: it keeps cumulative_len/position_ids (batch size 1)",
                    _setitem(collate, "use_varlen_attn", True),
                )
            )
        return findings
    why = (
        f"XTuner's default_collate_fn keeps document boundaries only at batch_size=1, got "
        f"{batch_size}"
        if name == "default_collate_fn"
        else f"collate function {name} is not known to keep document boundaries"
    )
    findings.append(
        Finding(
            "train_dataloader.collate_fn",
            f"packed rows: {why}",
            "use collate_fn=dict(type=rope_collate_fn, max_length=max_length) "
            "(from xtuner_rope import rope_collate_fn; any batch size)",
        )
    )
    return findings


OFFLINE_PACKING_KEY = "offline_packing"
WHOLE, CUT = "whole", "cut"
OFFLINE_PACKINGS = (WHOLE, CUT)


def offline_packing(cfg_dict: dict) -> str:
    """The config's ``offline_packing`` (default ``"whole"``), unchecked."""
    return _get(cfg_dict, OFFLINE_PACKING_KEY, WHOLE)


def _packing_mode_finding(cfg_dict: dict) -> list[Finding]:
    mode = offline_packing(cfg_dict)
    if mode in OFFLINE_PACKINGS:
        return []
    return [
        Finding(
            OFFLINE_PACKING_KEY,
            f"expected one of {OFFLINE_PACKINGS}, got {mode!r}",
            f'set {OFFLINE_PACKING_KEY} = "{WHOLE}" (the default: each dialogue whole in one '
            f'row) or "{CUT}" (XTuner\'s cut every max_length tokens, e.g. for continued '
            "pretraining on long texts), or delete it",
        )
    ]


def _lossless_packing_findings(cfg_dict: dict, loader: dict) -> list[Finding]:
    """XTuner's offline packing cuts dialogues and drops each shard's leftover: use ours."""
    findings = _packing_mode_finding(cfg_dict)
    if findings:
        return findings
    whole = offline_packing(cfg_dict) == WHOLE
    how = (
        "each dialogue whole in one row (best-fit decreasing), every dialogue once, nothing "
        "dropped; the number of rows per epoch changes (logged when the data is built). "
        f'Opt out: {OFFLINE_PACKING_KEY} = "{CUT}"'
        if whole
        else f'XTuner\'s cut of the whole stream ({OFFLINE_PACKING_KEY} = "{CUT}"): dialogues '
        "across a row edge are trained as pieces (the doctor counts them), the leftover kept "
        "as a short last row"
    )
    for where, dataset in _datasets(_get(loader, "dataset"), "train_dataloader.dataset"):
        if _offline_packs(dataset):
            findings += _intern_repo_findings(where, dataset, whole)
        if not _xtuner_packs(dataset):
            continue
        name = type_name(_get(dataset, "type"))
        if name == "process_hf_dataset":
            procs = _get(dataset, "map_num_proc", 32)
            findings.append(
                Finding(
                    f"{where}.type",
                    f"process_hf_dataset packs in map_num_proc={procs} worker(s) "
                    "and drops each worker's last leftover below max_length (tokens and "
                    "supervised labels lost), and cuts the dialogues at every max_length "
                    "tokens (a dialogue across a row edge is trained as two fragments)",
                    "set to lossless_process_hf_dataset(whole_dialogues="
                    f"{whole}) (xtuner_rope.data.packed_dataset, same arguments): {how}",
                    _replace_builder(dataset, whole),
                )
            )
        elif _get(dataset, "whole_dialogues", True) != whole:
            findings.append(
                Finding(
                    f"{where}.whole_dialogues",
                    f"{OFFLINE_PACKING_KEY} = {offline_packing(cfg_dict)!r} asks for "
                    + ("whole dialogues" if whole else "XTuner's cut"),
                    f"set to {whole}: {how}",
                    _setitem(dataset, "whole_dialogues", whole),
                )
            )
    return findings


def _intern_repo_findings(where: str, dataset: dict, whole: bool) -> list[Finding]:
    """XTuner's intern-repo ``build_packed_dataset`` cuts documents too: ours keeps them whole."""
    name = type_name(_get(dataset, "type"))
    if name == "build_packed_dataset" and whole:
        builder = LazyObject("xtuner_rope.data.intern_repo_packing", "build_whole_packed_dataset")

        def fix() -> None:
            dataset["type"] = builder
            dataset["whole_documents"] = True

        return [
            Finding(
                f"{where}.type",
                "build_packed_dataset concatenates the documents and cuts every packed_length "
                "tokens (a document across a row edge is trained as pieces) and drops the last "
                "partial row",
                "set to build_whole_packed_dataset(whole_documents=True) "
                "(xtuner_rope.data.intern_repo_packing, same arguments): each document whole in "
                "one row (best-fit decreasing; longer documents split into packed_length "
                f'pieces), nothing dropped. Opt out: {OFFLINE_PACKING_KEY} = "{CUT}"',
                fix,
            )
        ]
    if name == "build_whole_packed_dataset" and _get(dataset, "whole_documents", True) != whole:
        return [
            Finding(
                f"{where}.whole_documents",
                f"{OFFLINE_PACKING_KEY} asks for "
                + ("whole documents" if whole else "XTuner's cut"),
                f"set to {whole}",
                _setitem(dataset, "whole_documents", whole),
            )
        ]
    return []


def _replace_builder(dataset: dict, whole: bool):
    builder = LazyObject("xtuner_rope.data.packed_dataset", "lossless_process_hf_dataset")

    def fix() -> None:
        dataset["type"] = builder
        dataset["whole_dialogues"] = whole

    return fix


@register_findings("varlen")
def _varlen_findings(cfg: Config) -> list[Finding]:
    """The stock ``use_varlen_attn = True`` switch: served by the plugin, flash-attn or not."""
    if not _get(config_dict(cfg), "use_varlen_attn"):
        return []
    findings = [
        Finding(
            "use_varlen_attn",
            "XTuner's start-up check demands flash-attn and batch size 1 for it",
            "set to False at the top level only (the model, dataset and collate function keep "
            "theirs): xtuner-rope isolates documents itself, on every attention backend",
            _setitem(config_dict(cfg), "use_varlen_attn", False),
        )
    ]
    hooks = _get(config_dict(cfg), "custom_hooks") or []
    varlen = [h for h in hooks if type_name(_get(h, "type")) == "VarlenAttnArgsToMessageHubHook"]
    if varlen:

        def drop() -> None:
            hooks[:] = [h for h in hooks if not any(h is v for v in varlen)]

        findings.append(
            Finding(
                "custom_hooks",
                "VarlenAttnArgsToMessageHubHook publishes the boundaries that "
                "PackedBatchCheckHook publishes (checked) under the same MessageHub keys",
                "removed VarlenAttnArgsToMessageHubHook",
                drop,
            )
        )
    return findings


@register_findings("packing")
def _loader_findings(cfg: Config) -> list[Finding]:
    loader = _get(config_dict(cfg), "train_dataloader")
    if not isinstance(loader, dict):
        return []
    return _packing_findings(loader) + _lossless_packing_findings(config_dict(cfg), loader)
