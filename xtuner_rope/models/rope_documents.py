"""Where the documents of a rotary call are, so length-dependent RoPE goes per document.

Dynamic NTK and LongRoPE choose their frequencies from the length served (see
``ops.rope_documents``). The validated rotaries (``hf_rope``, ``internlm2_rope``) ask
:func:`rotary_document_lengths` for each token's document length whenever a call reaches past
the threshold. The documents are those the family's attention isolates, read the same way:

- the boundaries published for this batch (``PackedBatchCheckHook``, LLaVA's expanded rows,
  preference pairs), else position-id resets;
- for the transformers families only where every row starts at position 0 (a left-padded
  prompt is one sequence per row, as in ``models.hf``);
- under sequence parallel, the lengths of the full row, published for this rank's shard by
  ``sequence_parallel.shard_rows`` (the shard alone cannot know where its documents end).

No documents (one sequence per row, generation steps with a KV cache): None, and the rotary
keeps upstream's per-call choice. ``set_per_document_rope(model, False)`` (the config's
``per_document_rope = False``) turns per-document frequencies off: every packed document then
gets the frequencies of its call's longest one, as upstream computes them.
"""

from __future__ import annotations

import logging

import torch
from mmengine.logging import print_log
from torch import nn

from xtuner_rope.ops.rope_documents import document_lengths

from . import channel
from .runtime import batch_document_plan, hub_cumulative_len, rows_start_at_zero
from .sequence_parallel import sequence_parallel_active

__all__ = [
    "PER_DOCUMENT_KEY",
    "per_document_rope_setting",
    "reset_upstream_rotaries",
    "rotary_document_lengths",
    "set_per_document_rope",
]

# Top-level config key read by ValidatedRoPEHook: `per_document_rope = False` turns it off.
PER_DOCUMENT_KEY = "per_document_rope"

# The last answer, keyed on the tensors it came from: InternLM2 asks once per layer.
_LAST: dict = {}


def rotary_document_lengths(
    rotary: nn.Module,
    position_ids: torch.Tensor,
    b: int,
    s: int,
    device: torch.device,
    zero_start: bool,
) -> torch.Tensor | None:
    """Each token's document length ``[b, s]`` (int64), or None when the call holds no documents.

    Args:
        rotary: The calling rotary module (its ``training`` tells a sequence-parallel shard).
        position_ids: ``[b, s]`` or ``[1, s]`` integer positions of the call.
        b: Rows; s: row length (of this rank's shard under sequence parallel).
        device: Where the lengths are needed.
        zero_start: Documents only where every row starts at position 0 (the transformers
            families' attention rule; InternLM2's attention has none).
    """
    if sequence_parallel_active(rotary):
        lengths = channel.read_lengths()
        return None if lengths is None else lengths.to(device)
    published = hub_cumulative_len()
    if published is None and zero_start and not rows_start_at_zero(position_ids):
        return None
    plan = batch_document_plan(position_ids, b, s, device)
    if plan is None:
        return None
    if _LAST.get("plan") is not plan or _LAST.get("positions") is not position_ids:
        _LAST.clear()
        lengths = document_lengths(position_ids.to(device), plan.cu_seqlens, b, s)
        _LAST.update(plan=plan, positions=position_ids, lengths=lengths)
    return _LAST["lengths"]


def set_per_document_rope(model: nn.Module, enabled: bool) -> int:
    """Turn per-document frequencies on or off on every validated rotary of ``model``.

    Returns:
        How many rotary modules were set.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "per_document"):
            module.per_document = bool(enabled)
            count += 1
    return count


def per_document_rope_setting(runner) -> bool:
    """Apply the config's ``per_document_rope`` (default True) to the runner's patched model.

    ``per_document_rope = False`` in the config (or ``--cfg-options per_document_rope=False``)
    turns per-document frequencies off, e.g. to see ``xtuner-rope check`` fail without them.

    Returns:
        The setting applied.

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

    Upstream's dynamic NTK is stateful: transformers keeps grown frequencies until a call shorter
    than ``max_position_embeddings`` (one of exactly that length keeps them), and InternLM2's
    class keeps them for good. Running documents alone one after another (the references of
    ``xtuner-rope check`` and the tests) must start each from the loaded state, as a fresh copy.

    Returns:
        How many rotary modules were reset.
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
