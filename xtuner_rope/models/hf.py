"""Document-isolating attention and validated RoPE for the transformers families.

``patch_hf_model`` swaps the model's rotary module for ``HFValidatedRotaryEmbedding`` and gives
each layer a config copy naming ``PACKED_ATTENTION_KEY`` (``hf_packed_attention``, the original
kernel kept on the layer; Qwen2-MoE: ``moe_attention_forward``). Packed rows go through
``attention.packed_attention``; rows without boundaries and cached steps through the original.
"""

from __future__ import annotations

import copy
import sys
import types

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from xtuner_rope.ops.attention import packed_attention

from .families import attention_classes, family_names, family_of_class, rotary_classes
from .hf_rope import HFValidatedRotaryEmbedding
from .internlm2 import INTERNLM2_ATTENTION_CLASSES
from .runtime import batch_document_plan, choose_backend, hub_cumulative_len, rows_start_at_zero
from .sequence_parallel import (
    full_row_plan,
    sequence_parallel_active,
    sequence_parallel_attention,
    sequence_parallel_size,
)

# Attention and rotary classes of the supported families, by name (as XTuner's dispatch does);
# the table with each family's quirks is models.families.FAMILIES.
HF_ATTENTION_CLASSES = attention_classes()
HF_ROTARY_CLASSES = rotary_classes()
HF_FAMILIES = family_names()
PACKED_ATTENTION_KEY = "xtuner_rope_packed"
DENSE_KERNEL_ATTR = "xtuner_rope_dense_kernel"


def _plan(position_ids, b: int, s: int, kv_len: int, device: torch.device):
    """The packed layout of this call, or None where the original kernel must run."""
    if kv_len != s:  # cached keys: a generation step, whose mask the model already built
        return None
    if hub_cumulative_len() is None and (
        position_ids is None or not rows_start_at_zero(position_ids)
    ):
        return None  # no published boundaries, and a left-padded prompt is no pack
    return batch_document_plan(position_ids, b, s, device)


def _dense(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The original kernel, called exactly as the family's forward would have called it."""
    kernel = getattr(module, DENSE_KERNEL_ATTR)
    if kernel == "eager" or (kernel == "sdpa" and kwargs.get("output_attentions", False)):
        family = sys.modules[type(module).__module__]
        return family.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[kernel](module, query, key, value, attention_mask, **kwargs)


def _check_packable(module: nn.Module, plan, head_dim: int, kwargs: dict) -> None:
    """Refuse what the packed kernels do not compute, instead of computing something else."""
    name = type(module).__name__
    if kwargs.get("dropout", 0.0):
        raise ValueError(
            f"{name} layer {module.layer_idx}: attention dropout {kwargs['dropout']} is not "
            "supported on packed batches (the packed kernels have no dropout); set "
            "config.attention_dropout = 0.0, or collate with pack=False."
        )
    scaling = kwargs.get("scaling")
    if scaling is not None and abs(scaling - head_dim**-0.5) > 1e-12 * scaling:
        raise ValueError(
            f"{name} layer {module.layer_idx}: attention scaling {scaling} differs from "
            f"head_dim ** -0.5 = {head_dim**-0.5}, which the packed kernels use; this model "
            "cannot train on packed batches."
        )
    window = kwargs.get("sliding_window")
    if window is not None and plan.max_seqlen > window:
        raise ValueError(
            f"{name} layer {module.layer_idx}: a packed document of {plan.max_seqlen} tokens is "
            f"longer than the sliding window ({window}), which the packed kernels do not "
            "apply; keep documents within the window (max_length) or collate with pack=False."
        )


def hf_packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
):
    """``ALL_ATTENTION_FUNCTIONS`` entry: document-isolating on packed rows, else the original.

    Args:
        module: The calling attention layer (carries ``DENSE_KERNEL_ATTR``).
        query: ``[b, n_h, s, h_d]``; key, value: ``[b, n_kv, kv_len, h_d]`` (cache included).
        attention_mask: The model's mask for the original kernel (4-D additive or None).
        **kwargs: ``dropout``, ``scaling``, ``sliding_window``, ``position_ids`` ``[b, s]``, ...
            (forwarded to the original kernel).

    Returns:
        ``([b, s, n_h, h_d]`` attention output, attention weights or None).

    Raises:
        ValueError: A packed batch with dropout, a non-standard scaling or a document longer than
            the sliding window; a published ``cumulative_len`` not matching the batch.
    """
    # Rotation through a forward that bound the unpatched apply_rotary_pos_emb (fp32 cos/sin
    # promote q, k to fp32): back to the activation dtype, one rounding.
    query, key = query.to(value.dtype), key.to(value.dtype)
    b, _, s, h_d = query.shape
    if key.shape[-2] == s and sequence_parallel_active(module):  # a shard of the row
        _check_packable(
            module, full_row_plan(b, s * sequence_parallel_size(), query.device), h_d, kwargs
        )
        eager = getattr(module, DENSE_KERNEL_ATTR) == "eager"
        return sequence_parallel_attention(
            *(x.transpose(1, 2) for x in (query, key, value)), eager
        ), None
    plan = _plan(kwargs.get("position_ids"), b, s, key.shape[-2], query.device)
    if plan is None:
        return _dense(module, query, key, value, attention_mask, **kwargs)
    _check_packable(module, plan, h_d, kwargs)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [b, s, heads, h_d]
    return packed_attention(
        q, k, v, plan, choose_backend(query, getattr(module, DENSE_KERNEL_ATTR) == "eager")
    ), None


def moe_attention_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask=None,
    position_ids=None,
    past_key_value=None,
    output_attentions=False,
    use_cache=False,
    cache_position=None,
    position_embeddings=None,
    **kwargs,
):
    """Qwen2-MoE attention (any backend class): packed rows isolated, the rest upstream; the
    signature and return of transformers 4.48 ``Qwen2MoeAttention.forward``.
    """
    b, s, _ = hidden_states.shape
    cached = past_key_value.get_seq_length(self.layer_idx) if past_key_value is not None else 0
    plan = (
        None if output_attentions else _plan(position_ids, b, s, s + cached, hidden_states.device)
    )
    if plan is None:
        return type(self).forward(
            self,
            hidden_states,
            attention_mask,
            position_ids,
            past_key_value,
            output_attentions,
            use_cache,
            cache_position,
            position_embeddings,
            **kwargs,
        )
    family = sys.modules[type(self).__module__]
    q, k, v = (
        proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, heads, s, h_d]
        for proj in (self.q_proj, self.k_proj, self.v_proj)
    )
    cos, sin = position_embeddings
    q, k = family.apply_rotary_pos_emb(q, k, cos, sin)
    if past_key_value is not None:
        k, v = past_key_value.update(
            k, v, self.layer_idx, {"sin": sin, "cos": cos, "cache_position": cache_position}
        )
    q, k = q.to(v.dtype), k.to(v.dtype)
    config = self.config
    window = config.sliding_window if getattr(config, "use_sliding_window", False) else None
    _check_packable(
        self,
        plan,
        self.head_dim,
        dict(dropout=self.attention_dropout if self.training else 0.0, sliding_window=window),
    )
    eager = getattr(self, DENSE_KERNEL_ATTR) == "eager"
    out = packed_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), plan, choose_backend(q, eager)
    )  # [b, s, n_h, h_d]
    return self.o_proj(out.reshape(b, s, -1)), None, past_key_value


def is_patched_hf_attention(layer: nn.Module) -> bool:
    """True if ``layer`` is a supported family's attention routed to ``hf_packed_attention``
    (or, for a ``forward``-interface family, running ``moe_attention_forward``)."""
    family = family_of_class(type(layer).__name__)
    if family is None or not hasattr(layer, DENSE_KERNEL_ATTR):
        return False
    if family.interface == "forward":
        return getattr(layer.forward, "__func__", None) is moe_attention_forward
    config = getattr(layer, "config", None)
    return getattr(config, "_attn_implementation", None) == PACKED_ATTENTION_KEY


def rotation_modules(layers: list[nn.Module]) -> dict[str, bool]:
    """Modeling modules of ``layers`` whose ``apply_rotary_pos_emb`` gets
    ``patch_hf_fp32_rotation``, each with its pairing (True: interleaved, Cohere, whose apply
    upcasts itself: only the Triton kernel's calls are taken).
    """
    found = {}
    for layer in layers:
        family = family_of_class(type(layer).__name__)
        if family.fp32_apply or family.interleaved:
            found[type(layer).__module__] = family.interleaved
    return dict(sorted(found.items()))


def integration_for(model: nn.Module) -> str | None:
    """Which patch serves ``model`` (any wrapper): ``'internlm2'``, ``'hf'`` or None."""
    names = {type(m).__name__ for m in model.modules()}
    if names & set(INTERNLM2_ATTENTION_CLASSES):
        return "internlm2"
    if names & set(HF_ATTENTION_CLASSES):
        return "hf"
    return None


def _route(layers: list[nn.Module]) -> None:
    """Give each layer a config copy naming our key; one copy per original config."""
    copies: dict[int, object] = {}
    for layer in layers:
        if is_patched_hf_attention(layer):
            continue
        family = family_of_class(type(layer).__name__)
        if family.interface == "forward":  # one class per backend; the first is eager
            name = type(layer).__name__
            kernel = (
                "eager"
                if name == family.attention[0]
                else "flash_attention_2"
                if "Flash" in name
                else "sdpa"
            )
            setattr(layer, DENSE_KERNEL_ATTR, kernel)
            # An instance attribute, as XTuner's own dispatch does: other instances untouched.
            layer.forward = types.MethodType(moe_attention_forward, layer)
            continue
        original = layer.config
        if id(original) not in copies:
            routed = copy.copy(original)
            routed._attn_implementation = PACKED_ATTENTION_KEY
            copies[id(original)] = routed
        setattr(layer, DENSE_KERNEL_ATTR, original._attn_implementation)
        layer.config = copies[id(original)]


def _swap_rotaries(model: nn.Module, max_position: int | None) -> int:
    """Replace every upstream rotary module of a supported family; returns how many hold ours."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in HF_ROTARY_CLASSES:
                family = family_of_class(type(child).__name__)
                child = HFValidatedRotaryEmbedding.from_module(
                    child, max_position, family.interleaved
                )
                setattr(parent, name, child)
            if isinstance(child, HFValidatedRotaryEmbedding):
                if max_position is not None:
                    child.max_position = max_position
                count += 1
    return count


def patch_hf_model(model: nn.Module, max_position: int | None = None) -> int:
    """Give a model of a ``FAMILIES`` family the validated RoPE and document-isolating attention.

    The layers are found by class name inside any wrapper (DDP, DeepSpeed, PEFT, XTuner's);
    idempotent; ``max_position`` optionally overrides the largest position id the RoPE accepts.
    Returns the number of attention layers now routed to ``hf_packed_attention``.

    Raises:
        ValueError: No attention layer of a supported family, no rotary module on the model, or
            an unsupported ``rope_type``.
    """
    layers = [m for m in model.modules() if type(m).__name__ in HF_ATTENTION_CLASSES]
    if not layers:
        raise ValueError(
            f"patch_hf_model: {type(model).__name__} contains no attention layer of a supported "
            f"family ({HF_FAMILIES}: classes {', '.join(HF_ATTENTION_CLASSES)}). InternLM2 is "
            "served by patch_internlm2_attention; for other models drop ValidatedRoPEHook and "
            "train without packing (pack=False)."
        )
    if not _swap_rotaries(model, max_position):
        raise ValueError(
            f"patch_hf_model: {type(model).__name__} has {type(layers[0]).__name__} layers but "
            f"no model-level rotary module ({', '.join(HF_ROTARY_CLASSES)}); this layout "
            "(transformers other than 4.48?) is not supported."
        )
    ALL_ATTENTION_FUNCTIONS[PACKED_ATTENTION_KEY] = hf_packed_attention
    _route(layers)
    return len(layers)
