"""Where the documents of a rotary call are, so length-dependent RoPE goes per document.

The validated rotaries ask :func:`rotary_document_lengths` for each token's document length:
the published boundaries, else position-id resets (sequence parallel: the full row's); nothing
to go by (KV cache): None, upstream's per-call choice. ``set_per_document_rope(model, False)``
turns it off.
"""

from __future__ import annotations

import inspect
import logging

import torch
from mmengine.logging import print_log
from torch import nn

from xtuner_rope.ops.document_plan import DocumentPlan
from xtuner_rope.ops.host_copies import host_copy
from xtuner_rope.ops.rope_documents import document_lengths, host_document_lengths

from . import channel
from .runtime import batch_document_plan, hub_cumulative_len, rows_start_at_zero
from .sequence_parallel import sequence_parallel_active

__all__ = [
    "PER_DOCUMENT_KEY",
    "host_position_range",
    "install_row_lengths",
    "is_document_rotary",
    "per_document_rope_setting",
    "reset_upstream_rotaries",
    "rotary_document_lengths",
    "set_per_document_rope",
]

# Top-level config key read by ValidatedRoPEHook: `per_document_rope = False` turns it off.
PER_DOCUMENT_KEY = "per_document_rope"

# The last answer, keyed on the tensors it came from: InternLM2 asks once per layer.
_LAST: dict = {}


def _host_plan(
    rotary: nn.Module, position_ids: torch.Tensor, b: int, s: int, device: torch.device
) -> DocumentPlan | None:
    """This call's plan from boundaries published on the host (positions then count from 0 per
    document, checked by ``PackedBatchCheckHook``), else None (also under sequence parallel).
    """
    published = hub_cumulative_len()
    if not isinstance(published, torch.Tensor) or published.device.type != "cpu":
        return None
    if sequence_parallel_active(rotary):
        return None
    return batch_document_plan(position_ids, b, s, device)


def host_position_range(
    rotary: nn.Module, position_ids: torch.Tensor, b: int, s: int, device: torch.device
) -> tuple[int, int] | None:
    """(0, longest document - 1) from the published host boundaries, or None: the range
    ``check_position_ids(known_range=...)`` then needs no device read.
    """
    plan = _host_plan(rotary, position_ids, b, s, device)
    return None if plan is None else (0, plan.max_seqlen - 1)


def rotary_document_lengths(
    rotary: nn.Module,
    position_ids: torch.Tensor,
    b: int,
    s: int,
    device: torch.device,
    zero_start: bool,
) -> torch.Tensor | None:
    """Each token's document length ``[b, s]`` (int64), or None when the call holds no documents.

    On the CPU where the boundaries or the positions' host copy are known, and under sequence
    parallel; on ``device`` otherwise.

    Args:
        rotary: The calling rotary module (its ``training`` tells a sequence-parallel shard).
        position_ids: ``[b, s]`` or ``[1, s]`` integer positions of the call (``s``: this rank's
            shard's under sequence parallel).
        zero_start: Documents only where every row starts at position 0 (transformers' rule).
    """
    if sequence_parallel_active(rotary):
        lengths = channel.read_lengths()  # on the host as shard_rows publishes them
        if lengths is None or lengths.device.type == "cpu":
            return lengths
        return lengths.to(device)
    published = hub_cumulative_len()
    if published is None and zero_start and not rows_start_at_zero(position_ids):
        return None
    plan = batch_document_plan(position_ids, b, s, device)
    if plan is None:
        return padded_row_lengths(rotary, position_ids, b, s, device)
    if _LAST.get("plan") is not plan or _LAST.get("positions") is not position_ids:
        _LAST.clear()
        host = host_copy(position_ids)
        if isinstance(published, torch.Tensor) and published.device.type == "cpu":
            lengths = host_document_lengths(plan.host_cu_seqlens, b, s)  # [b, s] on the CPU
        elif host is not None:  # the collated ids: each document's last position, on the host
            lengths = document_lengths(host, plan.host_cu_seqlens, b, s)
        else:
            lengths = document_lengths(position_ids.to(device), plan.cu_seqlens, b, s)
        _LAST.update(plan=plan, positions=position_ids, lengths=lengths)
    return _LAST["lengths"]


class RowMask:
    """The 2-D ``attention_mask`` of a decoder's latest call, shared by the rotaries below it; kept
    until its next call (gradient checkpointing calls the rotary again in the backward).
    """

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.lengths: tuple | None = None  # (mask, position_ids, [b, s] lengths) of the last answer


def _row_mask_hook(state: RowMask, signature: inspect.Signature):
    """A forward pre-hook that records the call's ``attention_mask`` into ``state``."""

    def hook(module, args, kwargs):
        try:
            call = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # a call this decoder's signature does not take: it will say so
            call = {}
        mask = call.get("attention_mask")
        cache = call.get("past_key_values", call.get("past_key_value"))
        generating = call.get("use_cache") is True or cache is not None
        usable = isinstance(mask, torch.Tensor) and mask.dim() == 2 and not generating
        state.mask = mask if usable else None
        return None

    return hook


def install_row_lengths(model: nn.Module) -> int:
    """Let the validated rotaries of ``model`` know the real length of each padded row.

    Each decoder holding validated rotaries gets a forward pre-hook recording its 2-D mask
    (:func:`padded_row_lengths`); calls with a KV cache record nothing. Idempotent; returns how
    many decoders were hooked.
    """
    count = 0
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, nn.ModuleList) or hasattr(module, "_xtuner_rope_row_mask"):
            continue
        try:
            signature = inspect.signature(module.forward)
        except (TypeError, ValueError):
            continue
        if "attention_mask" not in signature.parameters:
            continue
        rotaries = [m for m in module.modules() if is_document_rotary(m)]
        if not rotaries:
            continue
        state = RowMask()
        module._xtuner_rope_row_mask = state
        module.register_forward_pre_hook(_row_mask_hook(state, signature), with_kwargs=True)
        for rotary in rotaries:
            rotary.row_mask = state
        count += 1
    return count


def is_document_rotary(module: nn.Module) -> bool:
    """True for a validated rotary that can give each document its own frequencies (it carries a
    ``per_document`` switch): :func:`install_row_lengths`' and :func:`set_per_document_rope`'s test.
    """
    return hasattr(module, "per_document")


def padded_row_lengths(
    rotary: nn.Module, position_ids: torch.Tensor, b: int, s: int, device: torch.device
) -> torch.Tensor | None:
    """Each token's row length ``[b, s]`` (last attended position + 1) for a call of padded rows;
    None without a recorded ``[b, s]`` mask for this call or when nothing is padded.
    """
    state = getattr(rotary, "row_mask", None)
    mask = None if state is None else state.mask
    if mask is None or tuple(mask.shape) != (b, s):
        return None
    cached = state.lengths
    if cached is not None and cached[0] is mask and cached[1] is position_ids:
        return cached[2]
    host_mask, host_positions = host_copy(mask), host_copy(position_ids)
    if host_mask is not None and host_positions is not None:  # the collated batch: no sync
        attended, positions = host_mask != 0, host_positions.expand(b, s)  # [b, s] on the CPU
    else:
        attended, positions = mask.to(device) != 0, position_ids.to(device).expand(b, s)
    lengths = None
    if not bool(attended.all()):
        last = torch.where(attended, positions, torch.full_like(positions, -1)).amax(dim=1)
        lengths = (last + 1).clamp(min=1)[:, None].expand(b, s)  # [b, s]
    state.lengths = (mask, position_ids, lengths)
    return lengths


def set_per_document_rope(model: nn.Module, enabled: bool) -> int:
    """Turn per-document frequencies on or off on every validated rotary of ``model``; returns how
    many rotary modules were set."""
    count = 0
    for module in model.modules():
        if is_document_rotary(module):
            module.per_document = bool(enabled)
            count += 1
    return count


def per_document_rope_setting(runner) -> bool:
    """Apply the config's ``per_document_rope`` (default True) to the runner's patched model;
    returns the setting applied.

    Raises:
        TypeError: the setting is not a bool.
    """
    cfg = getattr(runner, "cfg", None)
    enabled = cfg.get(PER_DOCUMENT_KEY, True) if cfg is not None else True
    if not isinstance(enabled, bool):
        raise TypeError(
            f"config setting {PER_DOCUMENT_KEY}: expected True or False, got {enabled!r} "
            f"({type(enabled).__name__}); leave it out (True) or set {PER_DOCUMENT_KEY} = False"
        )
    set_per_document_rope(runner.model, enabled)
    if not enabled:
        print_log(
            f"xtuner-rope: {PER_DOCUMENT_KEY} = False: documents of packed rows get the "
            "length-dependent RoPE frequencies of their row's longest document (upstream's "
            "per-call choice), not their own.",
            logger="current",
            level=logging.WARNING,
        )
    return enabled


def reset_upstream_rotaries(model: nn.Module) -> int:
    """Put the length state of unpatched rotaries back as a freshly loaded model has it.

    Upstream's dynamic NTK keeps grown frequencies (InternLM2's for good): documents run alone one
    after another (``xtuner-rope check``, the tests) must each start from the loaded state.
    Returns how many rotary modules were reset.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "original_max_seq_len"):
            # transformers' dynamic / longrope. `original_inv_freq` is a plain attribute that
            # `.to(device)` leaves where the model was built: the buffer stays where it is.
            module.inv_freq = module.original_inv_freq.to(module.inv_freq.device)
            module.max_seq_len_cached = module.original_max_seq_len
            count += 1
        elif "DynamicNTK" in type(module).__name__ and hasattr(module, "base"):
            # InternLM2's (XTuner's and the hub's): its constructor's fp32 frequencies
            device = module.inv_freq.device
            exponents = torch.arange(0, module.dim, 2, dtype=torch.int64).float().to(device)
            module.inv_freq = 1.0 / (module.base ** (exponents / module.dim))
            count += 1
    return count
