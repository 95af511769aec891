"""InternLM2: its attention forward with the validated RoPE and document isolation, and the patch.

The fused ``wqkv`` projection, the attention classes found by name (XTuner's and remote-code
copies), the dense path as each class computes it and the KV-cache contracts
(``internlm2_kv_cache``); the packed attention itself is ``ops.attention``.
"""

from __future__ import annotations

import math
import types

import torch
from torch import nn

from xtuner_rope.ops.attention import grouped_sdpa, packed_attention
from xtuner_rope.ops.rope import apply_rotary_pos_emb

from .internlm2_kv_cache import extend_cache, past_length
from .internlm2_rope import ValidatedRotaryEmbedding
from .runtime import batch_document_plan, choose_backend
from .sequence_parallel import sequence_parallel_active, sequence_parallel_attention

INTERNLM2_ATTENTION_CLASSES = (
    "InternLM2Attention",
    "InternLM2SdpaAttention",
    "InternLM2FlashAttention2",
)


def _dense_attention(layer: nn.Module, q, k, v, attention_mask, q_len: int) -> torch.Tensor:
    """The unpacked path, as the layer's own class computes it: ``[b, q_len, n_h, h_d]``.

    Args:
        q: ``[b, n_h, q_len, h_d]``; k, v: ``[b, n_kv, kv_len, h_d]`` (cache included).
        attention_mask: 4-D additive ``[b, 1, q_len, kv_len']`` (eager/SDPA), 2-D ``[b, kv_len]``
            (flash-attn), or None.
    """
    if type(layer).__name__ == "InternLM2FlashAttention2":
        target = layer.wqkv.weight.dtype if q.dtype == torch.float32 else q.dtype
        q, k, v = (x.transpose(1, 2).to(target) for x in (q, k, v))  # [b, len, heads, h_d]
        return layer._flash_attention_forward(q, k, v, attention_mask, q_len)
    n_rep = q.shape[1] // k.shape[1]
    mask = None if attention_mask is None else attention_mask[:, :, :, : k.shape[-2]]
    if type(layer).__name__ == "InternLM2SdpaAttention":
        out = grouped_sdpa(q, k, v, attn_mask=mask, is_causal=mask is None and q_len > 1)
        return out.transpose(1, 2)
    k = k.repeat_interleave(n_rep, dim=1)  # [b, n_h, kv_len, h_d]
    v = v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1])  # [b, n_h, q_len, kv_len]
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).transpose(1, 2)


def _project_qkv(layer: nn.Module, hidden_states: torch.Tensor):
    """InternLM2's fused ``wqkv`` split into q ``[b, s, n_h, h_d]``, k and v ``[b, s, n_kv, h_d]``;
    the fused layout is, per kv head, ``n_rep`` query heads then one key and one value head."""
    b, s, _ = hidden_states.shape
    n_kv, h_d = layer.num_key_value_heads, layer.head_dim
    n_rep = layer.num_key_value_groups
    qkv = layer.wqkv(hidden_states).view(b, s, n_kv, n_rep + 2, h_d)  # [b, s, n_kv, n_rep+2, h_d]
    q = qkv[..., :n_rep, :].reshape(b, s, n_kv * n_rep, h_d)  # [b, s, n_h, h_d]
    return q, qkv[..., -2, :], qkv[..., -1, :]


def internlm2_attention_forward(
    self,
    hidden_states,
    attention_mask=None,
    position_ids=None,
    past_key_value=None,
    output_attentions=False,
    use_cache=False,
    cache_position=None,
    **kwargs,
):
    """Drop-in ``forward`` for the InternLM2 attention classes: validated fp32 RoPE, documents
    isolated on packed batches; either KV-cache contract (``internlm2_kv_cache``); no attention
    weights.
    """
    b, s, _ = hidden_states.shape
    q, k, v = (x.transpose(1, 2) for x in _project_qkv(self, hidden_states))  # [b, heads, s, h_d]
    past_len = past_length(self, past_key_value)
    positions = position_ids
    if positions is None:  # the new tokens follow the cached ones
        positions = torch.arange(past_len, past_len + s)[None]  # [1, s]
    # fp32 [b, s, h_d] at the new tokens' positions: built once per forward, the same tensors
    # for every layer, in the kernels' dtype (no per-layer cast)
    cos, sin = self.rotary_emb(v, positions, dtype=torch.float32)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v, present = extend_cache(
        self, k, v, past_key_value, use_cache, dict(sin=sin, cos=cos, cache_position=cache_position)
    )
    # Boundaries only describe a fresh sequence: with cached keys, the model's mask is right.
    eager = type(self).__name__ == "InternLM2Attention"
    sharded = past_len == 0 and sequence_parallel_active(self)  # a shard of the row: all-to-all
    plan = None
    if past_len == 0 and not sharded:
        plan = batch_document_plan(position_ids, b, s, q.device)
    if sharded:
        out = sequence_parallel_attention(*(x.transpose(1, 2) for x in (q, k, v)), eager)
    elif plan is not None:
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))  # [b, s, heads, h_d]
        out = packed_attention(qs, ks, vs, plan, choose_backend(q, eager))
    else:
        out = _dense_attention(self, q, k, v, attention_mask, s)
    out = out.reshape(b, s, -1).to(hidden_states.dtype)  # [b, s, n_h * h_d]
    return self.wo(out), None, present


def patch_internlm2_attention(model: nn.Module, max_position: int | None = None) -> int:
    """Give every InternLM2 attention layer of ``model`` the validated RoPE and document-isolating
    attention (classes found by name, XTuner's and remote-code copies, inside any wrapper;
    idempotent); ``max_position`` optionally overrides the largest position id the RoPE accepts.
    Returns the number of InternLM2 attention layers now carrying the patch.

    Raises:
        ValueError: the model has no InternLM2 attention layer.
    """
    layers = [m for m in model.modules() if type(m).__name__ in INTERNLM2_ATTENTION_CLASSES]
    if not layers:
        raise ValueError(
            f"patch_internlm2_attention: {type(model).__name__} contains no InternLM2 attention "
            f"layer (looked for classes {', '.join(INTERNLM2_ATTENTION_CLASSES)}). Pass the "
            "InternLM2 model (or a wrapper around it), or drop ValidatedRoPEHook for other models."
        )
    for layer in layers:
        if not isinstance(layer.rotary_emb, ValidatedRotaryEmbedding):
            layer.rotary_emb = ValidatedRotaryEmbedding.from_module(
                layer.rotary_emb, max_position=max_position
            )
        # An instance attribute, as XTuner's own dispatch does: other instances are untouched.
        layer.forward = types.MethodType(internlm2_attention_forward, layer)
    return len(layers)
