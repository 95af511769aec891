"""Is a runner checkpoint complete? Judged cheaply, before anything loads it.

A zip-format ``.pth`` is complete when its central directory (written last) is there and
every member lies inside the file; a legacy file is loaded to be judged; a DeepSpeed folder when
its model states and every rank's optimizer states (``dp_world_size``) are.
:func:`newest_complete` finds what to resume from instead; :func:`refuse_incomplete` refuses.
"""

from __future__ import annotations

import os
import pickletools
import re
import zipfile
from dataclasses import dataclass

import torch

from .loading import load_checkpoint, runner_globals_allowed

CHECKPOINT_NAME = re.compile(r"^(iter|epoch)_(\d+)\.pth$")  # MMEngine's filename_tmpl
MODEL_STATES = re.compile(r"(^|_)mp_rank_\d+_model_states\.pt$")
ZERO3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint that was cut short (or misses a rank's file) is asked to be loaded."""


@dataclass(frozen=True)
class Verdict:
    """Whether a checkpoint is complete, and why not.

    Attributes:
        path: The checkpoint file or DeepSpeed folder.
        complete: True when every byte and file a load needs is there.
        reason: What is missing (expected vs found); empty when complete.
    """

    path: str
    complete: bool
    reason: str = ""


def _zip_reason(path: str, size: int) -> str:
    """Why a zip-format ``torch.save`` file is incomplete; empty when it is complete."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            end = archive.start_dir  # where the central directory begins
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return (
            f"{size} bytes without the zip central directory torch.save writes at the end "
            f"of a complete file ({err})"
        )
    if not any(m.filename.endswith("data.pkl") for m in members):
        return f"a zip archive of {size} bytes without the data.pkl torch.save writes"
    for member in members:
        if member.header_offset + member.compress_size > end:
            return (
                f"member {member.filename} ends at byte "
                f"{member.header_offset + member.compress_size}, after the central directory "
                f"at byte {end}"
            )
    return ""


def _legacy_reason(path: str, size: int) -> str:
    """Why a legacy ``torch.save`` file is incomplete (empty when complete): its five pickles are
    walked opcode by opcode (nothing executed), its storages checked by a weights-only load.
    """
    with open(path, "rb") as f:
        for _ in range(5):
            try:
                for _op in pickletools.genops(f):
                    pass
            except (ValueError, EOFError) as err:  # "pickle exhausted before seeing STOP"
                return f"{size} bytes that end inside the legacy format's pickles ({err})"
    try:
        load_checkpoint(path)
    except (EOFError, RuntimeError, OSError) as err:
        return f"{size} bytes that end early for torch's legacy format ({err})"
    except Exception:  # untrusted types and the like: the loader refuses them, not a cut
        return ""
    return ""


def _file_reason(path: str) -> str:
    """Why a checkpoint file is incomplete; empty when it is complete."""
    size = os.path.getsize(path)
    if size == 0:
        return "0 bytes: nothing was written"
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":
        return _zip_reason(path, size)
    if magic[:1] == b"\x80":  # a pickle: torch's legacy format
        return _legacy_reason(path, size)
    return f"{size} bytes that are neither torch.save's zip format nor its legacy pickle"


def deepspeed_layout(model_states: str) -> tuple[int | None, int]:
    """``(dp_world_size, ZeRO stage)`` stored in a DeepSpeed model-states file (its tensors mapped,
    not read); ``(None, 0)`` when the file cannot tell."""
    with runner_globals_allowed():
        try:
            state = torch.load(model_states, map_location="cpu", mmap=True, weights_only=True)
        except Exception:  # judged by the caller from the files alone
            return None, 0
    state = state if isinstance(state, dict) else {}
    world, config = state.get("dp_world_size"), state.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return (world if isinstance(world, int) else None), (stage if isinstance(stage, int) else 0)


def _folder_reason(path: str) -> str:
    """Why a DeepSpeed checkpoint folder is incomplete; empty when it is complete."""
    names = sorted(os.listdir(path))
    models = [n for n in names if MODEL_STATES.search(n)]
    if not models:
        return f"no *mp_rank_*_model_states.pt file (found {names or 'nothing'})"
    for name in [*models, *(n for n in names if OPTIM_STATES.match(n))]:
        reason = _file_reason(os.path.join(path, name))
        if reason:
            return f"{name} is incomplete: {reason}"
    world, stage = deepspeed_layout(os.path.join(path, models[0]))
    if world is None:
        return ""  # model states without a world size: nothing to count the ranks against
    wanted = [(OPTIM_STATES, "optim")] if stage >= 1 else []  # ZeRO-0 keeps it in the model's
    if any(ZERO3_MODEL_STATES.match(n) for n in names):  # ZeRO-3: one model file per rank too
        wanted.append((ZERO3_MODEL_STATES, "model"))
    for pattern, kind in wanted:
        missing = sorted(
            set(range(world)) - {int(m.group(1)) for m in map(pattern.match, names) if m}
        )
        if missing:
            return (
                f"{kind} states of data-parallel rank(s) {missing} missing: expected {world} "
                f"zero_pp_rank_*_{kind}_states.pt files (dp_world_size={world}, ZeRO stage "
                f"{stage}), found {world - len(missing)}"
            )
    return ""


def judge_checkpoint(path: str) -> Verdict:
    """Judge a checkpoint file (any ``torch.save`` file) or DeepSpeed folder complete or not; a
    path that does not exist is incomplete."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        reason = _folder_reason(path)
    elif os.path.isfile(path):
        reason = _file_reason(path)
    else:
        reason = "it does not exist"
    return Verdict(path, not reason, reason)


def checkpoint_number(path: str) -> tuple[str, int] | None:
    """``("iter", 8)`` for ``.../iter_8.pth``; None for a name MMEngine's scan would not write."""
    match = CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))
    return (match.group(1), int(match.group(2))) if match else None


def numbered_checkpoints(folder: str, kind: str = "iter") -> list[tuple[int, str]]:
    """``(number, path)`` of each ``kind_N`` (``"iter"`` or ``"epoch"``) checkpoint in ``folder``,
    lowest first; none when ``folder`` is not a folder.
    """
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        number = checkpoint_number(name)
        if number and number[0] == kind:
            found.append((number[1], os.path.join(folder, name)))
    return sorted(found)


def newest_complete(folder: str, kind: str = "iter", exclude: str | None = None) -> str | None:
    """The complete checkpoint of the highest number in ``folder`` (a work dir or ``out_dir``), or
    None; ``kind``: ``"iter"`` or ``"epoch"`` names, ``exclude``: a path already judged incomplete.
    """
    left_out = os.path.realpath(exclude or "")
    for _, path in reversed(numbered_checkpoints(folder, kind)):
        if os.path.realpath(path) != left_out and judge_checkpoint(path).complete:
            return path
    return None


def refuse_incomplete(path: str) -> None:
    """Raise if the checkpoint at ``path`` (to be loaded) is incomplete, naming what to resume from.

    Raises:
        IncompleteCheckpointError: It is incomplete (what is missing, and the newest complete
            checkpoint beside it with the ``--resume`` argument, or that there is none).
        FileNotFoundError: It does not exist.
    """
    verdict = judge_checkpoint(path)
    if verdict.complete:
        return
    if not os.path.exists(verdict.path):
        raise FileNotFoundError(f"{path} can not be found.")
    number = checkpoint_number(verdict.path)
    folder = os.path.dirname(os.path.normpath(verdict.path)) or "."
    best = newest_complete(folder, number[0] if number else "iter", exclude=verdict.path)
    instead = (
        f"The newest complete checkpoint beside it is {best}: resume with --resume {best}"
        if best
        else f"No complete checkpoint is beside it in {folder}: train again without --resume"
    )
    raise IncompleteCheckpointError(
        f"xtuner-rope: refused to load {verdict.path}: the checkpoint is incomplete "
        f"({verdict.reason}). A crash, a kill or a full disk while it was written leaves such a "
        f"checkpoint; a complete one ends with all of it. {instead}."
    )


__all__ = [
    "IncompleteCheckpointError",
    "Verdict",
    "checkpoint_number",
    "deepspeed_layout",
    "judge_checkpoint",
    "newest_complete",
    "numbered_checkpoints",
    "refuse_incomplete",
]
