"""The doctor's check of checkpoint space: the size of one checkpoint against the free disk.

The size is the newest complete checkpoint's, else estimated from the LLM's weight headers and
the config; ``max_keep_ckpts`` plus the one being written are held at once.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from mmengine.config import Config

from xtuner_rope.checkpoints.complete import newest_complete
from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.config.checkpoint_findings import llm_checkpoint_path
from xtuner_rope.config.fields import lazy_get as _get
from xtuner_rope.config.fields import type_name
from xtuner_rope.config.launch import deepspeed_zero_stage
from xtuner_rope.doctor.schedule import epoch_length

__all__ = [
    "checkpoint_space",
    "checkpoint_space_lines",
    "checkpoint_space_warnings",
    "checkpoints_at_once",
    "fits",
    "estimate_checkpoint_bytes",
    "run_work_dir",
    "size_text",
    "weight_shapes",
]

DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "float32": 4, "bfloat16": 2, "float16": 2}
# Per-parameter state tensors of torch's optimizers (step counters are scalars: not counted).
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "Adamax": 2, "Adagrad": 1, "RMSprop": 1, "SGD": 1}
ZERO_BYTES_PER_PARAMETER = 12  # DeepSpeed ZeRO: fp32 master copy + fp32 exp_avg + exp_avg_sq
# Without target_modules XTuner adapts every nn.Linear but these (find_all_linear_names, 0.2.0);
# embeddings are 2-D weights too, told apart by name.
NOT_LORA_HEADS = ("lm_head", "output_layer")
EMBEDDINGS = ("embed", "wte", "wpe")


def _local_dir(name: object) -> Path | None:
    """The folder holding ``name``'s weights: a local directory, or a hub id's cached snapshot."""
    if not isinstance(name, str):
        return None
    if os.path.isdir(name):
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached, not a hub id: the size cannot be estimated here
        return None


def weight_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """``{name: (shape, dtype)}`` of a checkpoint folder's weights (``*.safetensors`` or
    ``pytorch_model*.bin``; None without any), nothing loaded."""
    import torch
    from safetensors import safe_open

    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):  # headers only
        with safe_open(file, "pt") as f:
            for name in f.keys():
                info = f.get_slice(name)
                shapes[name] = (tuple(info.get_shape()), info.get_dtype())
    bins = [] if shapes else sorted(folder.glob("pytorch_model*.bin"))
    for file in bins:  # memory-mapped: shapes only
        for name, t in torch.load(file, map_location="cpu", mmap=True, weights_only=True).items():
            shapes[name] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
    return shapes or None


def lora_parameters(shapes: dict, lora: dict) -> int:
    """Parameters of the LoRA adapter ``lora`` (``r``, ``target_modules``) on these weights: each
    adapted ``[out, in]`` weight gets ``A: [r, in]`` and ``B: [out, r]``; without
    ``target_modules``, every 2-D weight but the heads and embeddings (as XTuner)."""
    r, targets = int(_get(lora, "r", 8)), _get(lora, "target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    total = 0
    for name, (shape, _) in shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2:
            continue
        if targets is None:
            leaf_module = module.rpartition(".")[2]
            if leaf_module in NOT_LORA_HEADS or any(e in leaf_module for e in EMBEDDINGS):
                continue
        elif module.rpartition(".")[2] not in targets:
            continue
        total += r * (shape[0] + shape[1])
    return total


def _train_dtype_bytes(llm: object, shapes: dict) -> int:
    """Bytes per weight as trained: ``model.llm.torch_dtype`` (``"auto"``: as stored), else fp32."""
    dtype = _get(llm, "torch_dtype")
    if dtype == "auto":
        return DTYPE_BYTES.get(next(iter(shapes.values()))[1], 4)
    return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)


def estimate_checkpoint_bytes(
    saved: int, trainable: int, weight_bytes: int, states: int, zero: int | None
) -> int:
    """Bytes of one checkpoint: the ``saved`` parameters (the adapter alone under LoRA) at
    ``weight_bytes`` plus the optimizer's ``states`` per ``trainable`` parameter (ZeRO stage
    ``zero``, None without DeepSpeed)."""
    if zero:  # the optimizer files hold fp32 partitions, whatever the training dtype
        return saved * weight_bytes + trainable * ZERO_BYTES_PER_PARAMETER
    return saved * weight_bytes + trainable * weight_bytes * states


def _config_text_bytes(cfg: Config) -> int:
    """Bytes of the config's text (MMEngine's checkpoint ``meta``); 0 when it cannot be printed."""
    try:
        return len(cfg.pretty_text.encode())
    except Exception:  # noqa: BLE001 - yapf's SyntaxError on a built object, and the like
        return 0


def _estimate(cfg: Config) -> tuple[int | None, str]:
    """The estimated size of one checkpoint of ``cfg`` and how it was estimated."""
    name = llm_checkpoint_path(cfg)
    folder = _local_dir(name)
    shapes = weight_shapes(folder) if folder is not None else None
    if not shapes:
        return None, f"no weight files of {name!r} on this machine to count its parameters"
    model = _get(config_dict(cfg), "model")
    total = sum(math.prod(shape) for shape, _ in shapes.values())
    lora = _get(model, "lora")
    saved = trainable = lora_parameters(shapes, lora) if isinstance(lora, dict) else total
    optimizer = type_name(_get(_get(_get(config_dict(cfg), "optim_wrapper"), "optimizer"), "type"))
    states = OPTIMIZER_STATES.get(optimizer.rpartition(".")[2], 2)
    zero = deepspeed_zero_stage(cfg)
    weight_bytes = _train_dtype_bytes(_get(model, "llm"), shapes)
    size = estimate_checkpoint_bytes(saved, trainable, weight_bytes, states, zero)
    size += _config_text_bytes(cfg)
    how = (
        f"estimated: {saved:,} saved parameters ({'LoRA adapter' if lora else 'all'} of "
        f"{total:,}) at {weight_bytes} bytes + "
        + (
            f"ZeRO-{zero} optimizer states of {trainable:,} at {ZERO_BYTES_PER_PARAMETER} bytes"
            if zero
            else f"{states} {optimizer or 'optimizer'} states of {trainable:,} at "
            f"{weight_bytes} bytes"
        )
        + " + the config's text"
    )
    return size, how


def _bytes_of(path: str) -> int:
    """Size of a checkpoint file, or the sum of a DeepSpeed checkpoint folder's files."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def checkpoints_at_once(hook: dict, iterations: int, max_epochs: int | None) -> int:
    """How many checkpoints the work dir holds at the peak of a save, for ``default_hooks.checkpoint``
    ``hook`` and a run of ``iterations`` (``max_epochs`` None: iteration-based)."""
    interval = int(_get(hook, "interval", -1))
    if interval <= 0:
        return 0
    steps = (max_epochs or 0) if _get(hook, "by_epoch", True) else iterations
    saves = steps // interval + (1 if _get(hook, "save_last", True) and steps % interval else 0)
    keep = int(_get(hook, "max_keep_ckpts", -1))
    return saves if keep <= 0 else min(saves, keep + 1)  # the newest is written, then one goes


def _free_bytes(folder: Path) -> tuple[int | None, str]:
    """Free bytes of the filesystem that ``folder`` is (or will be created) on."""
    probe = folder.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free, str(probe)
    except OSError:
        return None, str(probe)


def run_work_dir(cfg: Config, config: str, work_dir: str | None = None) -> str:
    """``xtuner train``'s work dir: ``work_dir``, else the config's, else ``./work_dirs/<stem>``."""
    return (
        work_dir
        or _get(config_dict(cfg), "work_dir")
        or os.path.join("./work_dirs", Path(config).stem)
    )


def checkpoint_space(cfg: Config, samples: int, batch_size: int, work_dir: str) -> dict:
    """The checkpoint figures of a run of ``cfg`` in ``work_dir`` (``samples``: train items).

    Returns:
        ``work_dir``, ``checkpoint_bytes`` (None: unknown), ``size_from``, ``at_once``,
        ``max_keep_ckpts``, ``needed_bytes``, ``free_bytes``, ``filesystem``.
    """
    loader, train = _get(config_dict(cfg), "train_dataloader"), _get(config_dict(cfg), "train_cfg")
    per_epoch = epoch_length(samples, batch_size, bool(_get(loader, "drop_last", False)))
    epochs = _get(train, "max_epochs")
    iterations = int(_get(train, "max_iters") or (epochs or 1) * per_epoch)
    hook = _get(_get(config_dict(cfg), "default_hooks"), "checkpoint") or {}
    at_once = checkpoints_at_once(hook, iterations, epochs)
    existing = newest_complete(work_dir, "epoch" if _get(hook, "by_epoch", True) else "iter")
    if existing is not None:
        size, how = _bytes_of(existing), f"measured: {existing}"
    else:
        size, how = _estimate(cfg)
    free, filesystem = _free_bytes(Path(work_dir))
    return {
        "work_dir": str(work_dir),
        "checkpoint_bytes": size,
        "size_from": how,
        "at_once": at_once,
        "max_keep_ckpts": _get(hook, "max_keep_ckpts", -1),
        "needed_bytes": None if size is None else size * at_once,
        "free_bytes": free,
        "filesystem": filesystem,
    }


def size_text(n: int) -> str:
    """``n`` bytes in MiB, GiB or TiB (one decimal)."""
    for unit, power in (("TiB", 40), ("GiB", 30)):
        if n >= 2**power:
            return f"{n / 2**power:,.1f} {unit}"
    return f"{n / 2**20:,.1f} MiB"


def fits(figures: dict | None) -> bool | None:
    """Whether the checkpoints kept at once fit in the free space; None when unknown."""
    if not figures or figures["needed_bytes"] is None or figures["free_bytes"] is None:
        return None
    return figures["needed_bytes"] <= figures["free_bytes"]


def checkpoint_space_warnings(figures: dict | None) -> list[str]:
    """A warning when the checkpoints the run keeps at once do not fit in the free space."""
    if fits(figures) is not False:
        return []
    keep = figures["max_keep_ckpts"]
    kept = (
        "every checkpoint kept"
        if keep is None or keep <= 0
        else f"max_keep_ckpts={keep}, and the newest is written before the oldest goes"
    )
    return [
        f"checkpoints: {figures['at_once']:,} checkpoints of {size_text(figures['checkpoint_bytes'])}"
        f" ({figures['size_from']}) need {size_text(figures['needed_bytes'])} at once in "
        f"{figures['work_dir']} ({kept}), "
        f"but {figures['filesystem']} has {size_text(figures['free_bytes'])} free: the run would "
        "stop at a checkpoint with the disk full\n  -> make room, lower max_keep_ckpts "
        "(save_total_limit in PART 1), or give a --work-dir on a disk with space"
    ]


def checkpoint_space_lines(figures: dict | None) -> list[str]:
    """The summary line of the checkpoint figures."""
    if not figures:
        return []
    if figures["checkpoint_bytes"] is None:
        return [f"checkpoints  size unknown ({figures['size_from']})"]
    free = "unknown" if figures["free_bytes"] is None else size_text(figures["free_bytes"])
    return [
        f"checkpoints  {size_text(figures['checkpoint_bytes'])} each ({figures['size_from']}); "
        f"{figures['at_once']:,} at once need {size_text(figures['needed_bytes'])}, "
        f"{free} free in {figures['filesystem']}"
    ]
