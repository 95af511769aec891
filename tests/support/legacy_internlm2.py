"""A first-generation InternLM2 for tests: the KV-cache contract of the hub's early remote code.

Early ``modeling_internlm2.py`` revisions (internlm/internlm2-chat-7b at release, the copy
InternVL vendors) differ from the current code that XTuner ships in how the attention layers
meet the cache:

- the rotary is called as ``rotary_emb(v, seq_len=kv_len)`` and returns ``[kv_len, h_d]``
  tables whose rows the attention picks with ``position_ids``;
- each layer's cache is a tuple ``(k, v)`` of ``[b, n_kv, past, h_d]`` tensors; new keys and
  values are concatenated to it and ``(k, v)`` is returned as the layer's "present" when
  ``use_cache`` (None otherwise); the attention layers have no ``layer_idx``;
- the model builds the 4-D additive mask with the past length, and
  ``prepare_inputs_for_generation`` slices ``input_ids`` by ``past_key_values[0][0].shape[2]``;
- the model class does not support transformers ``Cache`` objects, so ``generate`` keeps the
  tuples (``_supports_cache_class`` is False, the default old remote code got).

This module rebuilds that contract around XTuner's InternLM2 classes, written from the
description above: the parameters are XTuner's, so ``legacy_from`` loads the weights of any
tiny model built by ``xtuner_rope.demo.tiny.build_tiny_internlm2`` unchanged.
"""

import math

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast
from xtuner._lite.modelings.internlm2 import modeling_internlm2 as xtuner_internlm2


class LegacyRotaryEmbedding(nn.Module):
    """fp32 rotary tables addressed by length: ``forward(x, seq_len)`` -> ``[seq_len, h_d]``."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim, self.base = dim, base
        self.max_position_embeddings = max_position_embeddings
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("inv_freq", 1.0 / base**exponents, persistent=False)

    @torch.no_grad()
    def forward(self, x, seq_len):
        positions = torch.arange(seq_len, device=x.device, dtype=torch.float32)  # [seq_len]
        angles = positions[:, None] * self.inv_freq.to(x.device)  # [seq_len, h_d/2]
        emb = torch.cat((angles, angles), dim=-1)  # [seq_len, h_d]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Same class name as upstream's: patch_internlm2_attention finds the layers by class name.
class InternLM2Attention(xtuner_internlm2.InternLM2Attention):
    """Eager attention with a tuple KV cache and length-addressed rotary tables."""

    def __init__(self, config):
        super().__init__(config, layer_idx=0)
        del self.layer_idx  # the first-generation layers never knew their index
        self.rotary_emb = LegacyRotaryEmbedding(
            self.head_dim, self.max_position_embeddings, self.rope_theta
        )

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_value=None,
        output_attentions=False,
        use_cache=False,
        **kwargs,
    ):
        b, s, _ = hidden_states.shape
        n_kv, n_rep, h_d = self.num_key_value_heads, self.num_key_value_groups, self.head_dim
        # Fused layout: per kv head, n_rep query heads, then one key and one value head.
        qkv = self.wqkv(hidden_states).view(b, s, n_kv, n_rep + 2, h_d)
        q = qkv[..., :n_rep, :].reshape(b, s, n_kv * n_rep, h_d).transpose(1, 2)  # [b, n_h, s, h_d]
        k = qkv[..., -2, :].transpose(1, 2)  # [b, n_kv, s, h_d]
        v = qkv[..., -1, :].transpose(1, 2)  # [b, n_kv, s, h_d]
        past = 0 if past_key_value is None else past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(v, seq_len=past + s)  # [past + s, h_d]
        cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)  # [b, 1, s, h_d]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)  # [b, n_kv, past + s, h_d]
            v = torch.cat([past_key_value[1], v], dim=2)
        present = (k, v) if use_cache else None
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(h_d)  # [b, n_h, s, past + s]
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, s, n_kv * n_rep * h_d)  # [b, s, n_h * h_d]
        return self.wo(out), None, present


def causal_mask_with_past(attention_mask, b, s, past, dtype, device):
    """Additive ``[b, 1, s, past + s]`` mask: causal over absolute positions, padding masked.

    Args:
        attention_mask: ``[b, past + s]`` 1/0 padding mask, or None (no padding).
    """
    kv = past + s
    query = torch.arange(past, kv, device=device)[:, None]  # [s, 1] absolute query positions
    allowed = torch.arange(kv, device=device)[None, :] <= query  # [s, kv]
    allowed = allowed[None, None].expand(b, 1, s, kv)  # [b, 1, s, kv]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :].bool()
    return torch.zeros(b, 1, s, kv, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


class LegacyInternLM2Model(xtuner_internlm2.InternLM2Model):
    """The decoder stack with per-layer tuple caches and a mask built from the past length."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            layer.attention = InternLM2Attention(config)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        use_cache = self.config.use_cache if use_cache is None else use_cache
        hidden = self.tok_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        b, s, _ = hidden.shape
        past = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=hidden.device)[None]  # [1, s]
        mask = causal_mask_with_past(attention_mask, b, s, past, hidden.dtype, hidden.device)
        presents = () if use_cache else None
        for idx, layer in enumerate(self.layers):
            outputs = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_value=None if past_key_values is None else past_key_values[idx],
                use_cache=use_cache,
            )
            hidden = outputs[0]
            if use_cache:
                presents += (outputs[1],)
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(hidden), past_key_values=presents
        )


class LegacyInternLM2ForCausalLM(xtuner_internlm2.InternLM2ForCausalLM):
    """Causal LM whose ``generate`` runs on legacy tuple caches, as early remote code did."""

    _supports_cache_class = False
    _supports_quantized_cache = False
    _supports_static_cache = False

    def __init__(self, config):
        super().__init__(config)
        self.model = LegacyInternLM2Model(config)

    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None, **kwargs
    ):
        if past_key_values is not None:
            past = past_key_values[0][0].shape[2]
            # Only the tokens the cache has not seen (at least the last one).
            input_ids = input_ids[:, min(past, input_ids.shape[1] - 1) :]
        position_ids = kwargs.get("position_ids")
        if attention_mask is not None and position_ids is None:
            # Left padding: count real tokens; pads get position 1, as the old code wrote it.
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            position_ids = position_ids[:, -input_ids.shape[1] :]
        inputs = {"input_ids": input_ids}
        if inputs_embeds is not None and past_key_values is None:
            inputs = {"inputs_embeds": inputs_embeds}
        return {
            **inputs,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "use_cache": kwargs.get("use_cache"),
            "attention_mask": attention_mask,
        }


def legacy_from(model):
    """A ``LegacyInternLM2ForCausalLM`` holding the weights of XTuner's ``model`` (eval mode)."""
    config = type(model.config).from_dict(model.config.to_dict())
    config.attn_implementation = "eager"
    legacy = LegacyInternLM2ForCausalLM(config)
    legacy.load_state_dict(model.state_dict(), strict=True)
    return legacy.to(model.dtype).eval()
