"""The doctor's check of checkpoint space: the size of one checkpoint against the free disk.

A run that fills its disk at a checkpoint stops there (``checkpoints.atomic`` names the bytes
needed), after hours of training. The doctor knows the figures before: the size of one checkpoint
and how many of them the work dir holds at once, against the free space of its filesystem.

- **The size** is the work dir's newest complete checkpoint's real size when one exists (a
  resumed or repeated run writes the same kind). Otherwise it is estimated from the LLM's weight
  files (their headers: names, shapes; nothing is loaded) and the config: what the model's
  ``state_dict`` holds (every weight for full fine-tuning; only the LoRA adapter, which XTuner's
  ``SupervisedFinetune`` saves alone, under ``model.lora``) in the training dtype, plus the
  optimizer's per-parameter states of the trainable parameters (AdamW: two, in the parameter's
  dtype; DeepSpeed ZeRO: an fp32 master copy and two fp32 moments, 12 bytes a parameter), plus
  the config's text (MMEngine's ``meta``).
- **How many at once**: ``default_hooks.checkpoint.max_keep_ckpts`` (every save of the run when
  it is not positive), plus the one being written: with the plugin the oldest is deleted only
  after the new one is complete. Never more than the run saves (its iterations from the dataset,
  one process, ``save_last`` included).

Only the LLM of ``model.llm`` is estimated (text SFT, DPO/ORPO/reward, LLaVA's LLM); a vision
tower or projector is not counted, and a ``ref_llm`` is not saved. When the size cannot be
known (weights not on this machine), the figures say so and nothing is judged.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
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


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a ``.safetensors`` file: ``{name: {dtype, shape, data_offsets}}``."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))  # little-endian u64, then the JSON
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def weight_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """``{name: (shape, dtype)}`` of a Hugging Face checkpoint's weights, nothing loaded.

    Args:
        folder: The checkpoint directory (``*.safetensors`` or ``pytorch_model*.bin``).

    Returns:
        Every tensor's shape and stored dtype; None when the folder has no weight file.
    """
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {
            name: (tuple(info["shape"]), info["dtype"])
            for file in files
            for name, info in _safetensors_header(file).items()
        }
    import torch

    shapes = {}
    for file in sorted(folder.glob("pytorch_model*.bin")):  # memory-mapped: shapes only
        for name, t in torch.load(file, map_location="cpu", mmap=True, weights_only=True).items():
            shapes[name] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
    return shapes or None


def lora_parameters(shapes: dict, lora: dict) -> int:
    """Parameters of the LoRA adapter ``lora`` (``r``, ``target_modules``) on these weights.

    Each adapted ``[out, in]`` weight gets ``A: [r, in]`` and ``B: [out, r]``. Without
    ``target_modules`` XTuner adapts every linear layer but one named ``lm_head`` or
    ``output_layer`` (InternLM2's head, ``output``, is adapted): here every 2-D weight whose
    module is not one of those or an embedding.
    """
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
    """Bytes per weight as trained: ``torch_dtype`` of ``model.llm``, else fp32 (the default of
    ``from_pretrained``); ``"auto"``: the stored dtype."""
    dtype = _get(llm, "torch_dtype")
    if dtype == "auto":
        return DTYPE_BYTES.get(next(iter(shapes.values()))[1], 4)
    return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)


def estimate_checkpoint_bytes(
    saved: int, trainable: int, weight_bytes: int, states: int, zero: int | None
) -> int:
    """Bytes of one checkpoint: the saved weights plus the optimizer's states.

    Args:
        saved: Parameters in the model's ``state_dict`` (the adapter alone under LoRA).
        trainable: Parameters the optimizer updates.
        weight_bytes: Bytes per parameter of the training dtype.
        states: Per-parameter state tensors of the optimizer (AdamW: 2).
        zero: The DeepSpeed ZeRO stage, None without DeepSpeed.
    """
    if zero:  # the optimizer files hold fp32 partitions, whatever the training dtype
        return saved * weight_bytes + trainable * ZERO_BYTES_PER_PARAMETER
    return saved * weight_bytes + trainable * weight_bytes * states


def _config_text_bytes(cfg: Config) -> int:
    """Bytes of the config's text, which MMEngine's checkpoint ``meta`` keeps (0 when the
    config cannot be printed: objects built into it)."""
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
    """How many checkpoints the work dir holds at the peak of a save.

    Args:
        hook: ``default_hooks.checkpoint`` (``interval``, ``by_epoch``, ``max_keep_ckpts``,
            ``save_last``; MMEngine's defaults where absent).
        iterations: Training iterations of the run.
        max_epochs: Epochs of the run (for an epoch-based hook); None when iteration-based.
    """
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
    """The work dir ``xtuner train config [--work-dir work_dir]`` writes to: the argument, else
    the config's ``work_dir``, else ``./work_dirs/<config stem>`` (``xtuner/tools/train.py``)."""
    return (
        work_dir
        or _get(config_dict(cfg), "work_dir")
        or os.path.join("./work_dirs", Path(config).stem)
    )


def checkpoint_space(cfg: Config, samples: int, batch_size: int, work_dir: str) -> dict:
    """The checkpoint figures of a run of ``cfg`` in ``work_dir``.

    Args:
        cfg: The started config.
        samples: Items of the train dataset (packs, when packed offline).
        batch_size: ``train_dataloader.batch_size``.
        work_dir: Where the run writes its checkpoints.

    Returns:
        ``work_dir``, ``checkpoint_bytes`` (None when unknown), ``size_from`` (the checkpoint
        measured, or how it was estimated), ``at_once``, ``needed_bytes``, ``free_bytes`` and
        ``filesystem`` (the existing folder whose free space was read).
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


def _size(n: int) -> str:
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
        f"checkpoints: {figures['at_once']:,} checkpoints of {_size(figures['checkpoint_bytes'])}"
        f" ({figures['size_from']}) need {_size(figures['needed_bytes'])} at once in "
        f"{figures['work_dir']} ({kept}), "
        f"but {figures['filesystem']} has {_size(figures['free_bytes'])} free: the run would "
        "stop at a checkpoint with the disk full\n  -> make room, lower max_keep_ckpts "
        "(save_total_limit in PART 1), or give a --work-dir on a disk with space"
    ]


def checkpoint_space_lines(figures: dict | None) -> list[str]:
    """The summary line of the checkpoint figures."""
    if not figures:
        return []
    if figures["checkpoint_bytes"] is None:
        return [f"checkpoints  size unknown ({figures['size_from']})"]
    free = "unknown" if figures["free_bytes"] is None else _size(figures["free_bytes"])
    return [
        f"checkpoints  {_size(figures['checkpoint_bytes'])} each ({figures['size_from']}); "
        f"{figures['at_once']:,} at once need {_size(figures['needed_bytes'])}, "
        f"{free} free in {figures['filesystem']}"
    ]
