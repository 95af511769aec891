"""Refuse a config that needs a feature whose third-party patch was skipped in this process.

``xtuner_rope.compat`` skips a patch (one ``CompatPatchSkipped`` warning) where the installed
release is outside the versions the patch was written for, a name it replaces is missing, or
it raised. :data:`NEEDS` maps each patch to the configs that need its feature; such a config
is refused here, naming the feature, the patch, the versions that have it and the pip command.
A config that does not need it trains as usual. Patches that only turn a crash into a clearer
error are in :data:`NOT_REFUSED` with the reason: without them the run still fails loudly.
Before those, :func:`version_findings` refuses torch or DeepSpeed outside the supported range
(``compat.versions``): one finding per package, and no second one for its patches.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from mmengine.config import Config

from xtuner_rope.compat import (
    RECORDS,
    SUPPORTED,
    config_dict,
    cpu_only,
    skip_message,
    skipped,
    unsupported,
)
from xtuner_rope.models.checkpoint_config import read_checkpoint_config

from .fields import lazy_get, offline_packs, type_name, walk_datasets, xtuner_packs
from .internvl import is_internvl
from .launch import deepspeed_argument, deepspeed_zero_stage
from .multimodal import is_llava
from .preference import preference_dataset
from .startup import Finding, register_findings

__all__ = ["NEEDS", "NOT_REFUSED", "needs_table", "patch_findings", "version_findings"]


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


# patch -> (the configs that need its feature, in words; the predicate). docs/compat.md lists it.
NEEDS: dict[str, tuple[str, Callable[[Config], bool]]] = {
    "patch_torch_cpu_bf16_query": ("every run on a CPU-only machine", lambda cfg: cpu_only()),
    "patch_bitsandbytes_triton_probe": (
        "LoRA / QLoRA configs (`lora` or `quantization_config` in `model`)",
        lambda cfg: any(
            _has_key(lazy_get(config_dict(cfg), "model"), k)
            for k in ("lora", "quantization_config")
        ),
    ),
    "register_internlm2_auto_classes": (
        "a local InternLM2 checkpoint without remote code (`auto_map`)",
        _local_internlm2_without_code,
    ),
    "patch_mmengine_dist_init_on_cpu": (
        "several processes on a CPU-only machine",
        _multiprocess_cpu,
    ),
    "patch_mmengine_ddp_device_ids_on_cpu": (
        "several processes on a CPU-only machine",
        _multiprocess_cpu,
    ),
    "patch_deepspeed_cpu_allgather_grad_mode": (
        "DeepSpeed ZeRO-1/2 on a CPU-only machine",
        _zero(1, 2),
    ),
    "patch_deepspeed_zero3_cpu_gather": ("DeepSpeed ZeRO-3 on a CPU-only machine", _zero(3)),
    "patch_checkpoint_loading": ("`resume`, `load_from` or `--resume`", _loads_checkpoint),
    "patch_checkpoint_writes": ("every run with MMEngine's `CheckpointHook`", _checkpoint_hook),
    "patch_model_resource_llm_path": (
        "LLaVA / InternVL configs",
        lambda cfg: is_llava(cfg) or is_internvl(cfg),
    ),
    "patch_set_model_resource_llm_path": (
        "LLaVA / InternVL configs",
        lambda cfg: is_llava(cfg) or is_internvl(cfg),
    ),
    "patch_xtuner_preference_rank": ("DPO / ORPO", _preference_model("DPO", "ORPO")),
    "patch_xtuner_preference_target_zero": ("DPO / ORPO", _preference_model("DPO", "ORPO")),
    "patch_preference_unpacked_pairs": (
        "preference datasets (`build_preference_dataset`)",
        lambda cfg: preference_dataset(cfg) is not None,
    ),
    "patch_dpo_predict_reference": (
        "DPO with a `val_dataloader`",
        lambda cfg: _model_type(cfg) == "DPO" and _evaluates(cfg),
    ),
    "patch_sft_sequence_parallel_loss": ("`sequence_parallel_size > 1`", _sequence_parallel),
    "patch_xtuner_train_sequence_parallel_check": (
        "`sequence_parallel_size > 1`",
        _sequence_parallel,
    ),
    "patch_internlm2_generation_from_embeds": (
        "LLaVA with `EvaluateChatHook(evaluation_images=...)`",
        _evaluation_images,
    ),
    "patch_internvl_loading": ("InternVL configs", is_internvl),
    "patch_internvl_rank": ("InternVL configs", is_internvl),
    "patch_internvl_dataset_template": ("InternVL configs", is_internvl),
    "patch_internvl_predict": (
        "InternVL with a `val_dataloader`",
        lambda cfg: is_internvl(cfg) and _evaluates(cfg),
    ),
    "patch_llava_predict_labels": (
        "LLaVA with a `val_dataloader`",
        lambda cfg: is_llava(cfg) and _evaluates(cfg),
    ),
    "xtuner_pack_step": (
        "XTuner's offline packing (`process_hf_dataset` packing, `lossless_process_hf_dataset`)",
        lambda cfg: any(xtuner_packs(d) for d in _datasets(cfg)),
    ),
    "xtuner_tokenize_step": (
        "XTuner's offline packing and intern-repo packed datasets (their truncation counted, "
        "pretraining documents split)",
        lambda cfg: any(xtuner_packs(d) or offline_packs(d) for d in _datasets(cfg)),
    ),
    "xtuner_intern_repo_packer": (
        "intern-repo packed datasets (`build_packed_dataset`, `build_whole_packed_dataset`)",
        lambda cfg: any(offline_packs(d) for d in _datasets(cfg)),
    ),
    "keep_other_model_paths": ("LLaVA configs", is_llava),
    "patch_llava_expansion_check": ("LLaVA configs", is_llava),
    "patch_xtuner_zero_read_fp32": (
        "a `pretrained_pth` (XTuner reads a DeepSpeed folder through it)",
        lambda cfg: _has_key(lazy_get(config_dict(cfg), "model"), "pretrained_pth"),
    ),
}

# Patches whose absence leaves a loud failure, not a silently wrong run: never refused.
NOT_REFUSED = {
    "patch_sft_forward_names_missing_hook": "a clearer error; without it the run still fails",
    "patch_preference_map_fn_errors": "a clearer error; without it the map still fails",
    "patch_mmengine_warmup_rounding": "a clearer error; without it MMEngine still fails",
    "patch_mmengine_host_copies": "speed only; without it the batch is read back once per step",
    "patch_xtuner_varlen_hook_host_copies": "speed only; without it the boundaries are read "
    "back once per step",
    "patch_xtuner_tokenize_counted": "a count in the log; without it the data are the same",
    "patch_preference_truncation_counted": "a count in the log; without it the pairs are the same",
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
    """One conflict per package outside its supported range that ``cfg`` uses.

    torch is used by every config; DeepSpeed by a DeepSpeed run (mmengine 0.10.6 cannot even
    import DeepSpeed >= 0.19.7, so the run would die inside MMEngine after the model build).
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
    """One conflict per skipped patch whose feature ``cfg`` needs (see :data:`NEEDS`).

    A patch written for a package outside its supported range is left to
    :func:`version_findings` (one message per package, not one per patch).
    """
    findings = []
    outside = unsupported()
    for name in skipped():
        if name not in NEEDS or any(dist in outside for dist in RECORDS[name].versions):
            continue
        needed_by, needs = NEEDS[name]
        if needs(cfg):
            record = RECORDS[name]
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
        needed_by = NEEDS[name][0] if name in NEEDS else f"never ({NOT_REFUSED[name]})"
        rows.append(f"| `{name}` | {record.feature} | {needed_by} |")
    return "\n".join(rows)
