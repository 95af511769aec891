"""Causal grouped-query SDPA written out for the tests' references (any torch >= 2.4).

``enable_gqa`` came with torch 2.5: the reference repeats the kv heads itself (query head h
reads kv head h // n_rep, InternLM2's ``repeat_kv``) and calls plain causal SDPA.
"""

import torch
import torch.nn.functional as F


def causal_gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q [..., n_h, L, h_d]`` over ``k, v [..., n_kv, L, h_d]``."""
    n_rep = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(n_rep, dim=-3)  # [..., n_h, L, h_d]
    v = v.repeat_interleave(n_rep, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
