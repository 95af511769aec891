"""The bottom of ``xtuner-rope check``: the config started as ``xtuner train`` starts it, its
Runner built, its first batches."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from mmengine.config import Config

from xtuner_rope.config.as_xtuner_train import start_file
from xtuner_rope.config.fields import type_name
from xtuner_rope.doctor.diagnose import build_collate_fn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CheckRequest:
    """What the user asked ``xtuner-rope check`` for (the command's options); every kind's
    ``run(cfg, request)`` reads the fields it needs (:mod:`xtuner_rope.check.kinds`)."""

    config: str
    cfg_options: dict | None = None
    batches: int = 1
    work_dir: Path = Path("work_dirs/check")
    dtype: str | None = None
    max_documents: int = 8
    new_tokens: int = 8


def start_config(path: str, cfg_options: dict | None = None) -> Config:
    """The config as ``xtuner train`` has it (``fromfile``, ``model_resource``, ``--cfg-options``).

    Raises:
        ConfigConflict: the plugin's start-up refuses a setting (message names the edit).
    """
    return start_file(path, cfg_options)


def build_runner(cfg: Config, work_dir: Path):
    """MMEngine's ``Runner`` of the config (one unsharded model on this device, hooks built)."""
    from mmengine.runner import Runner

    cfg = copy.deepcopy(cfg)
    cfg.work_dir = str(work_dir)
    cfg.launcher = "none"
    cfg.load_from, cfg.resume = None, False
    cfg.log_level = "WARNING"  # the verdict is the output, not the Runner's config dump
    return Runner.from_cfg(cfg)


def _deepspeed_dtype(cfg: Config) -> torch.dtype | None:
    import json

    ds = (cfg.get("strategy") or {}).get("config")
    if isinstance(ds, str) and Path(ds).is_file():
        ds = json.loads(Path(ds).read_text(encoding="utf-8"))
    if not isinstance(ds, dict):
        return None
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (ds.get(key) or {}).get("enabled") is True:
            return dtype
    return None


def train_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The dtype the config trains in on ``device``. CPU: float32 (no AMP there). GPU: DeepSpeed's
    bf16/fp16, else ``AmpOptimWrapper``'s (float16 unset), else the ``llm``'s, else float32."""
    if device.type == "cpu":
        return torch.float32
    optim = cfg.get("optim_wrapper") or {}
    llm = (cfg.get("model") or {}).get("llm") or {}
    torch_dtype = llm.get("torch_dtype")
    if _deepspeed_dtype(cfg) is not None:
        return _deepspeed_dtype(cfg)
    if type_name(optim.get("type")) == "AmpOptimWrapper":
        return DTYPES.get(str(optim.get("dtype") or "float16"), torch.float16)
    return torch_dtype if isinstance(torch_dtype, torch.dtype) else torch.float32


def first_batches(cfg: Config, count: int) -> list[tuple[dict, list[list[int]] | None]]:
    """The first ``count`` batches of the config's dataset and collate function, in order.

    Returns:
        ``(data, dataset_boundaries)`` per batch: ``data`` as ``collate_fn`` returns it
        (``{'data': ..., 'data_samples': ...}``), and, for XTuner packs that did not record
        their boundaries (stock ``pack_to_max_length`` without ``use_varlen_attn``), each
        row's boundaries from the same packs built with ``use_varlen_attn=True``; else None.
    """
    from xtuner.registry import BUILDER

    loader = cfg.train_dataloader
    collate_fn, _, _ = build_collate_fn(loader)
    # XTuner's shuffle_before_pack seeds `datasets`' shuffle from numpy's global state: the
    # same state gives the same packs when they are built again with their boundaries.
    state = np.random.get_state()
    dataset = BUILDER.build(loader.dataset)
    batch_size = int(loader.get("batch_size", 1))
    recorded = None
    if (
        len(dataset)
        and "cumulative_len" not in dataset[0]
        and type_name(loader.dataset.get("type")) == "process_hf_dataset"
        and loader.dataset.get("pack_to_max_length", True)
    ):
        np.random.set_state(state)
        recorded = _recorded_packs(loader.dataset, dataset, count * batch_size)
    batches = []
    for i in range(0, min(count * batch_size, len(dataset)), batch_size):
        items = [dataset[j] for j in range(i, min(i + batch_size, len(dataset)))]
        cus = None if recorded is None else [recorded[j] for j in range(i, i + len(items))]
        batches.append((collate_fn(items), cus))
    return batches


def _recorded_packs(dataset_cfg: dict, dataset, n: int) -> list[list[int]]:
    """Boundaries of XTuner's packs, from the same dataset built with ``use_varlen_attn=True``."""
    from xtuner.registry import BUILDER

    varlen_cfg = copy.deepcopy(dataset_cfg)
    varlen_cfg["use_varlen_attn"] = True
    varlen = BUILDER.build(varlen_cfg)
    out = []
    for j in range(min(n, len(dataset))):
        if list(varlen[j]["input_ids"]) != list(dataset[j]["input_ids"]):
            raise ValueError(
                f"xtuner-rope check: pack {j} differs when the dataset records its boundaries "
                "(use_varlen_attn=True): cannot tell where its documents are. Set "
                "train_dataloader.dataset.use_varlen_attn=True (same packs, boundaries "
                "recorded), or enable the plugin, whose start-up does that."
            )
        out.append([int(c) for c in varlen[j]["cumulative_len"]])
    return out


def plugin_hooks(runner) -> dict:
    """The runner's hooks by class name."""
    return {type(h).__name__: h for h in runner.hooks}


def apply_patch(runner, hooks: dict) -> bool:
    """Run the plugin's hooks' ``before_train`` as training does; True if the model was patched."""
    for name in ("ValidatedRoPEHook", "PackedBatchCheckHook"):
        if name in hooks:
            hooks[name].before_train(runner)
    return "ValidatedRoPEHook" in hooks


class PreparedRunner(NamedTuple):
    """A Runner ready to be measured: its model moved to the dtype checked, its hooks by name."""

    runner: object
    device: torch.device
    dtype: torch.dtype
    hooks: dict


def prepared_runner(cfg: Config, work_dir: Path, dtype: str | None = None) -> PreparedRunner:
    """The config's Runner (:func:`build_runner`), its model in the dtype checked.

    Args:
        dtype: Override of the training dtype (``float32``, ``bfloat16``, ``float16``); default:
            :func:`train_dtype`.
    """
    runner = build_runner(cfg, Path(work_dir))
    device = next(runner.model.parameters()).device
    dt = DTYPES[dtype] if dtype else train_dtype(cfg, device)
    runner.model.to(dt)
    return PreparedRunner(runner, device, dt, plugin_hooks(runner))
