"""A DeepSpeed ZeRO checkpoint resumed on another number of processes: refused before loading.

DeepSpeed 0.19.6 saves one optimizer-state file per data-parallel rank and fails on another
number after everything is built. :func:`refuse_other_world_size` (``--resume`` and auto-resume)
names both numbers, the command on the saved one, and ``zero_to_fp32`` for a new run.
"""

from __future__ import annotations

import os
import re

from .complete import MODEL_STATES, deepspeed_layout

_WORLD_ENV = "WORLD_SIZE"  # set by torchrun (XTuner's --launcher pytorch) and by slurm setups


class WorldSizeMismatchError(RuntimeError):
    """A ZeRO checkpoint written by N data-parallel processes is resumed on another number."""


def current_world_size() -> int:
    """The number of processes of this run, as the launcher set it (1 without a launcher)."""
    value = os.environ.get(_WORLD_ENV, "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def saved_world_size(path: str) -> tuple[int | None, int]:
    """``(dp_world_size, ZeRO stage)`` of a DeepSpeed checkpoint folder; ``(None, 0)`` else."""
    if not os.path.isdir(path):
        return None, 0
    models = sorted(n for n in os.listdir(path) if MODEL_STATES.search(n))
    if not models:
        return None, 0
    return deepspeed_layout(os.path.join(path, models[0]))


def _commands(path: str, saved: int) -> str:
    """The two ways on: resume on ``saved`` processes, or convert the weights for ``load_from``."""
    folder, tag = os.path.split(os.path.normpath(path))
    out = os.path.join(folder, re.sub(r"\.pth$", "", tag) + "_fp32")
    return (
        f"Resume on {saved} processes: NPROC_PER_NODE={saved} xtuner train CONFIG --launcher "
        f"pytorch --deepspeed DS_CONFIG --resume {path} (nodes x processes per node = {saved}). "
        "Or continue on this number from the weights only (the optimizer state and the "
        "iteration count start anew): convert them with DeepSpeed's zero_to_fp32, "
        f"python -m deepspeed.utils.zero_to_fp32 {folder} {out} --tag {tag}, then train without "
        f"--resume and with --cfg-options load_from={os.path.join(out, 'pytorch_model.bin')}"
    )


def refuse_other_world_size(path: str, world_size: int | None = None) -> None:
    """Raise if ``path`` (the checkpoint to resume; all but a DeepSpeed folder passes) is a ZeRO
    checkpoint written by another number of processes than ``world_size`` (default:
    :func:`current_world_size`).

    Raises:
        WorldSizeMismatchError: ZeRO stage >= 1 and ``dp_world_size`` differs (the message names
            both and the commands that work).
    """
    saved, stage = saved_world_size(path)
    world = current_world_size() if world_size is None else world_size
    if saved is None or stage < 1 or saved == world:
        return
    raise WorldSizeMismatchError(
        f"xtuner-rope: refused to resume {path}: it is a DeepSpeed ZeRO-{stage} checkpoint "
        f"written by {saved} data-parallel processes (dp_world_size={saved}: its optimizer "
        f"states are split into {saved} zero_pp_rank_*_optim_states.pt files), and this run has "
        f"{world} ({_WORLD_ENV}={world}). DeepSpeed 0.19.6 cannot split them anew on load (it "
        "stops after the model is built: 'Automatic adjustment of ZeRO's optimizer state "
        f"partitioning with a new world size is not currently supported'). {_commands(path, saved)}."
    )


__all__ = [
    "WorldSizeMismatchError",
    "current_world_size",
    "refuse_other_world_size",
    "saved_world_size",
]
