"""Refuse a config that needs a feature whose third-party patch was skipped in this process.

Each patch's record (``compat.records``) says which configs need its feature (``needs``: words
and a condition's name, evaluated by :data:`CONDITIONS`) or why none is refused
(``not_refused``); such a config is refused with the feature, the patch, the versions and the
pip command. :func:`version_findings` first refuses torch or DeepSpeed outside the supported
range (``compat.versions``): one finding per package.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from mmengine.config import Config

from xtuner_rope.compat.devices import cpu_only
from xtuner_rope.compat.guard import skip_message, skipped
from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.compat.records import RECORDS
from xtuner_rope.compat.versions import SUPPORTED, unsupported
from xtuner_rope.models.checkpoint_config import read_checkpoint_config

from .fields import lazy_get, offline_packs, type_name, walk_datasets, xtuner_packs
from .findings import Finding
from .internvl import is_internvl
from .launch import deepspeed_argument, deepspeed_zero_stage
from .multimodal import is_llava
from .preference import preference_dataset
from .startup import register_findings

__all__ = ["CONDITIONS", "needs_table", "patch_findings", "version_findings"]


def _model_type(cfg: Config) -> str:
    return type_name(lazy_get(lazy_get(config_dict(cfg), "model"), "type"))


def _has_key(node: object, key: str) -> bool:
    """True if ``key`` holds a value other than None anywhere below ``node``."""
    if isinstance(node, dict):
        return dict.get(node, key) is not None or any(_has_key(v, key) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_key(v, key) for v in node)
    return False


def _multiprocess_cpu(cfg: Config) -> bool:
    return cpu_only() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _zero(*stages: int) -> Callable[[Config], bool]:
    return lambda cfg: cpu_only() and deepspeed_zero_stage(cfg) in stages


def _local_internlm2_without_code(cfg: Config) -> bool:
    """A local checkpoint of model type ``internlm2`` without ``auto_map`` (remote code)."""
    top = config_dict(cfg)
    for key in ("pretrained_model_name_or_path", "llm_name_or_path"):
        path = lazy_get(top, key)
        if isinstance(path, str) and Path(path).expanduser().is_dir():  # local: no hub read
            meta = read_checkpoint_config(path)
            if meta.get("model_type") == "internlm2" and meta.get("auto_map") is None:
                return True
    return False


def _datasets(cfg: Config) -> list[dict]:
    top = config_dict(cfg)
    return [
        dataset
        for loader in ("train_dataloader", "val_dataloader", "test_dataloader")
        for _, dataset in walk_datasets(lazy_get(lazy_get(top, loader), "dataset"), loader)
    ]


def _evaluates(cfg: Config) -> bool:
    return isinstance(lazy_get(config_dict(cfg), "val_dataloader"), dict)


def _checkpoint_hook(cfg: Config) -> bool:
    hook = lazy_get(lazy_get(config_dict(cfg), "default_hooks"), "checkpoint")
    return type_name(lazy_get(hook, "type")).endswith("CheckpointHook")


def _loads_checkpoint(cfg: Config) -> bool:
    top = config_dict(cfg)
    return bool(lazy_get(top, "resume") or lazy_get(top, "load_from")) or "--resume" in sys.argv


def _evaluation_images(cfg: Config) -> bool:
    hooks = lazy_get(config_dict(cfg), "custom_hooks") or []
    return is_llava(cfg) and any(
        type_name(lazy_get(h, "type")) == "EvaluateChatHook" and lazy_get(h, "evaluation_images")
        for h in hooks
    )


def _sequence_parallel(cfg: Config) -> bool:
    return int(lazy_get(config_dict(cfg), "sequence_parallel_size", 1) or 1) > 1


def _preference_model(*names: str) -> Callable[[Config], bool]:
    return lambda cfg: _model_type(cfg) in names


def _lora(cfg: Config) -> bool:
    model = lazy_get(config_dict(cfg), "model")
    return any(_has_key(model, k) for k in ("lora", "quantization_config"))


def _multimodal(cfg: Config) -> bool:
    return is_llava(cfg) or is_internvl(cfg)


def _evaluating(predicate: Callable[[Config], bool]) -> Callable[[Config], bool]:
    return lambda cfg: predicate(cfg) and _evaluates(cfg)


def _any_dataset(packs: Callable[[dict], bool]) -> Callable[[Config], bool]:
    return lambda cfg: any(packs(d) for d in _datasets(cfg))


# A condition's name (a record's ``needs[1]``, ``compat.records``) -> whether a config meets it.
CONDITIONS: dict[str, Callable[[Config], bool]] = {
    "cpu": lambda cfg: cpu_only(),
    "lora": _lora,
    "local_internlm2_without_code": _local_internlm2_without_code,
    "multiprocess_cpu": _multiprocess_cpu,
    "zero12_cpu": _zero(1, 2),
    "zero3_cpu": _zero(3),
    "loads_checkpoint": _loads_checkpoint,
    "checkpoint_hook": _checkpoint_hook,
    "deepspeed_checkpoint_hook": lambda cfg: _checkpoint_hook(cfg) and _uses_deepspeed(cfg),
    "multimodal": _multimodal,
    "llava": is_llava,
    "internvl": is_internvl,
    "dpo_orpo": _preference_model("DPO", "ORPO"),
    "preference_dataset": lambda cfg: preference_dataset(cfg) is not None,
    "dpo_evaluates": _evaluating(_preference_model("DPO")),
    "internvl_evaluates": _evaluating(is_internvl),
    "llava_evaluates": _evaluating(is_llava),
    "sequence_parallel": _sequence_parallel,
    "llava_evaluation_images": _evaluation_images,
    "xtuner_packs": _any_dataset(xtuner_packs),
    "xtuner_or_offline_packs": _any_dataset(lambda d: xtuner_packs(d) or offline_packs(d)),
    "offline_packs": _any_dataset(offline_packs),
    "pretrained_pth": lambda cfg: _has_key(lazy_get(config_dict(cfg), "model"), "pretrained_pth"),
}


def _uses_deepspeed(cfg: Config) -> bool:
    """A DeepSpeed run: ``--deepspeed``, a ``DeepSpeedStrategy`` or ``DeepSpeedOptimWrapper``."""
    top = config_dict(cfg)
    strategy = type_name(lazy_get(lazy_get(top, "strategy"), "type"))
    optim = type_name(lazy_get(lazy_get(top, "optim_wrapper"), "type"))
    return (
        deepspeed_zero_stage(cfg) is not None
        or deepspeed_argument() is not None
        or strategy.endswith("DeepSpeedStrategy")
        or optim == "DeepSpeedOptimWrapper"
    )


_USES = {"torch": lambda cfg: True, "deepspeed": _uses_deepspeed}


@register_findings("patches")
def version_findings(cfg: Config) -> list[Finding]:
    """One conflict per package outside its supported range that ``cfg`` uses (torch: every config;
    DeepSpeed: a DeepSpeed run).
    """
    return [
        Finding(
            setting=f"the installed {dist} (the start-up refuses {SUPPORTED[dist].used_by})",
            problem=message,
            edit=SUPPORTED[dist].install,
        )
        for dist, message in unsupported().items()
        if _USES[dist](cfg)
    ]


@register_findings("patches")
def patch_findings(cfg: Config) -> list[Finding]:
    """One conflict per skipped patch whose feature ``cfg`` needs (its record's ``needs``); a
    package outside its range is left to :func:`version_findings`.
    """
    findings = []
    outside = unsupported()
    for name in skipped():
        record = RECORDS.get(name)
        if record is None or record.needs is None:
            continue
        if any(dist in outside for dist in record.versions):
            continue
        needed_by, condition = record.needs
        if CONDITIONS[condition](cfg):
            findings.append(
                Finding(
                    setting=f"{record.feature} ({needed_by})",
                    problem=f"needs a patch this environment cannot take: {skip_message(record)}",
                    edit=f"install the versions it supports ({record.supported()}), or leave "
                    f"out what needs '{record.feature}'",
                )
            )
    return findings


def needs_table() -> str:
    """The Markdown table of docs/compat.md's "What the start-up refuses" section."""
    rows = ["| Patch | Feature | Refused at start-up, if skipped, for |", "|---|---|---|"]
    for name, record in RECORDS.items():
        needed_by = record.needs[0] if record.needs else f"never ({record.not_refused})"
        rows.append(f"| `{name}` | {record.feature} | {needed_by} |")
    return "\n".join(rows)
