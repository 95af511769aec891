"""The dtype ``xtuner-rope convert pth_to_hf`` saves in, and what a cast to it loses.

``--dtype bf16|fp16|fp32``, else the trained dtype (:func:`trained_dtype`); :func:`cast_module`
counts the values overflowed to ``inf`` and flushed to zero, :func:`describe_cast` names them.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
LISTED = 10  # tensors named one by one in the report; the rest are counted


@dataclass(frozen=True)
class CastLoss:
    """What casting tensor ``name`` lost: finite values ``overflowed`` to ``inf``, nonzero values
    ``flushed`` to 0, of ``numel``."""

    name: str
    overflowed: int
    flushed: int
    numel: int


def cast_losses(name: str, old: torch.Tensor, new: torch.Tensor) -> CastLoss:
    """The values of ``old`` (any shape) that its cast ``new`` overflowed or flushed."""
    overflowed = int((torch.isfinite(old) & torch.isinf(new)).sum())
    flushed = int(((old != 0) & (new == 0)).sum())
    return CastLoss(name, overflowed, flushed, old.numel())


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> list[CastLoss]:
    """Cast a model's floating parameters and buffers to ``dtype`` in place, one at a time; one
    :class:`CastLoss` per tensor cast (meta tensors cast, not counted)."""
    losses = []
    tensors = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in tensors:
        if not tensor.is_floating_point() or tensor.dtype == dtype:
            continue
        new = tensor.data.to(dtype)
        if not tensor.is_meta:
            losses.append(cast_losses(name, tensor.data, new))
        tensor.data = new
    return losses


def describe_cast(losses: list[CastLoss], dtype: torch.dtype) -> str:
    """What the cast to ``dtype`` lost (:func:`cast_module`'s ``losses``): one line, or the
    tensors (the first :data:`LISTED` named) with their counts."""
    name = NAMES.get(dtype, str(dtype))
    lossy = [loss for loss in losses if loss.overflowed or loss.flushed]
    if not lossy:
        return (
            f"xtuner-rope convert: cast {len(losses)} tensor(s) to {name}: no value "
            "overflowed to inf or was flushed to zero."
        )
    overflowed = sum(loss.overflowed for loss in lossy)
    flushed = sum(loss.flushed for loss in lossy)
    lines = [
        f"xtuner-rope convert: WARNING: the cast to {name} lost values in {len(lossy)} of "
        f"{len(losses)} tensor(s): {overflowed} overflowed to inf, {flushed} nonzero flushed "
        "to zero. Convert with --dtype fp32 (or bf16, whose range is fp32's) to keep them:"
    ]
    for loss in lossy[:LISTED]:
        lines.append(
            f"  {loss.name}: {loss.overflowed} overflowed, {loss.flushed} flushed (of {loss.numel})"
        )
    if len(lossy) > LISTED:
        lines.append(f"  ... and {len(lossy) - LISTED} more tensor(s)")
    return "\n".join(lines)


def _model_states(checkpoint: str) -> dict[str, torch.Tensor]:
    """The tensors that name the run's dtype: a ``.pth``'s ``state_dict``, a DeepSpeed module."""
    if os.path.isfile(checkpoint):
        state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)
        return state.get("state_dict", state)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        path = os.path.join(checkpoint, name)
        if os.path.isfile(path):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=False)["module"]
    raise FileNotFoundError(
        f"xtuner-rope convert: {checkpoint} is neither a checkpoint file nor a DeepSpeed folder "
        "with mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt: give the "
        "iter_N.pth that xtuner train wrote, or pass --dtype."
    )


def trained_dtype(checkpoint: str) -> torch.dtype:
    """The most common floating dtype of ``checkpoint``'s tensors (``iter_N.pth``, a file or a
    DeepSpeed folder); fp32 when none.

    Raises:
        FileNotFoundError: ``checkpoint`` is neither (the message says what to give).
    """
    counts = Counter(
        t.dtype
        for t in _model_states(checkpoint).values()
        if torch.is_tensor(t) and t.is_floating_point()
    )
    return counts.most_common(1)[0][0] if counts else torch.float32


def save_dtype(asked: str | None, fp32: bool, checkpoint: str) -> tuple[torch.dtype, str]:
    """The dtype to save in and where it came from: ``--dtype`` (``asked``) or ``--fp32``, else
    the trained dtype of ``checkpoint``.

    Raises:
        ValueError: ``--fp32`` together with another ``--dtype``.
    """
    if fp32 and asked not in (None, "fp32"):
        raise ValueError(
            f"xtuner-rope convert pth_to_hf: --fp32 and --dtype {asked} ask for two dtypes: "
            f"give one (--dtype {asked} alone, or --fp32 alone)."
        )
    if asked or fp32:
        return DTYPES[asked or "fp32"], "asked"
    dtype = trained_dtype(checkpoint)
    return dtype, f"the dtype of the trained weights in {checkpoint}; --dtype chooses another"


__all__ = [
    "DTYPES",
    "save_dtype",
    "CastLoss",
    "cast_losses",
    "cast_module",
    "describe_cast",
    "trained_dtype",
]
