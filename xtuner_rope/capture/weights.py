"""The weights of a run's LLM as a plain (unpatched, unwrapped) model loads them.

A PEFT LLM is merged into a copy; ZeRO-3 parameters are gathered first; a PEFT LLM under ZeRO-3
is refused (:func:`plain_weights_refusal`).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

__all__ = ["is_peft", "is_zero3", "plain_state_dict", "plain_weights_refusal"]


def is_peft(module: nn.Module) -> bool:
    """True for a PEFT-wrapped model (LoRA/QLoRA adapters)."""
    return hasattr(module, "peft_config") and hasattr(module, "merge_and_unload")


def is_zero3(module: nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 partitions the module's parameters (``ds_id`` on each)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def plain_weights_refusal(module: nn.Module, who: str) -> str | None:
    """Why the weights of ``module`` cannot be given to a plain model; None when they can."""
    if is_peft(module) and is_zero3(module):
        return (
            f"{who}: negative_control=True gives an unpatched copy of the LLM the run's "
            "weights, but this LLM is LoRA (PEFT) under DeepSpeed ZeRO-3, whose adapters cannot "
            "be merged into a copy while partitioned. Set negative_control=False (the capture "
            "and compare_llava_capture still run), or run the control under ZeRO-2 or on one "
            "process."
        )
    return None


def plain_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s weights (full, PEFT merged, ZeRO-3 gathered) under the plain model's names,
    fp32 on the CPU.

    Raises:
        ValueError: a PEFT LLM under ZeRO-3 (:func:`plain_weights_refusal`).
    """
    refusal = plain_weights_refusal(module, "plain_state_dict")
    if refusal:
        raise ValueError(refusal)
    if is_peft(module):
        module = copy.deepcopy(module).merge_and_unload()
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    gathered = contextlib.nullcontext()
    if params:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered:
        return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
