"""Pure-torch kernels with the contract of ``torch.nn.attention.varlen.varlen_attn``.

The real kernel runs only on CUDA (on CPU it raises NotImplementedError for
``aten::_flash_attention_forward``). These stand in for it where it cannot run, so that the glue
of the ``'varlen'`` packed backend (boundaries, layouts, GQA, dtypes, max lengths, both argument
styles) is tested on CPU through ``attention.VARLEN_KERNEL``; ``tests/test_gpu.py`` checks them
against the real kernel on a GPU. Both refuse what the real kernel refuses or silently gets
wrong (fp32 inputs, non-int32 or foreign-device boundaries, a ``max_q`` below a document length),
so a glue mistake fails here instead of on a GPU.

- ``varlen_attn_2_12``: torch >= 2.12, ``(..., *, return_aux, scale, window_size, enable_gqa)``;
  causal is ``window_size=(-1, 0)``.
- ``varlen_attn_2_10``: torch 2.10-2.11, ``(..., is_causal=False, return_aux=None)``; query and
  key/value carry the same number of heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be [T, H, D], got shape {tuple(x.shape)}")
        if x.dtype not in (torch.float16, torch.bfloat16) or x.dtype != query.dtype:
            raise RuntimeError(f"{name}: FlashAttention only supports fp16 and bf16, got {x.dtype}")
    for name, cu, total, most in (
        ("cu_seq_q", cu_seq_q, query.shape[0], max_q),
        ("cu_seq_k", cu_seq_k, key.shape[0], max_k),
    ):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != query.device:
            raise RuntimeError(
                f"{name} must be a 1-D int32 tensor on {query.device}, "
                f"got {cu.dtype} {tuple(cu.shape)} on {cu.device}"
            )
        lengths = cu[1:] - cu[:-1]
        if cu[0] != 0 or cu[-1] != total or (lengths < 0).any():
            raise ValueError(f"{name} = {cu.tolist()} does not cover the {total} tokens")
        if lengths.max() > most:
            raise ValueError(f"{name}: a sequence of {int(lengths.max())} tokens > max {most}")
    if not torch.equal(cu_seq_q, cu_seq_k):
        raise ValueError("this reference covers self-attention only (cu_seq_q == cu_seq_k)")


def _attend(query, key, value, cu_seq, causal, scale, n_rep):
    """Each sequence alone, fp32 softmax, output rounded once to ``query.dtype``."""
    pieces = []
    for start, end in zip(cu_seq[:-1].tolist(), cu_seq[1:].tolist()):
        # [T, H, D] -> [H, n, D] in fp32
        q, k, v = (x[start:end].transpose(0, 1).float() for x in (query, key, value))
        k, v = (x.repeat_interleave(n_rep, dim=0) for x in (k, v))  # head h reads kv h // n_rep
        pieces.append(
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(0, 1)
        )  # [n, H, D]
    return torch.cat(pieces).to(query.dtype)


def varlen_attn_2_12(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """``varlen_attn`` as of torch 2.12+: ``[T, H_q, D]`` out; GQA only with ``enable_gqa``."""
    _check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    if seqused_k is not None or block_table is not None or return_aux is not None:
        raise NotImplementedError("the reference covers training attention only")
    n_q, n_kv = query.shape[1], key.shape[1]
    if (not enable_gqa and n_q != n_kv) or n_q % n_kv:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got "
            f"Hq={n_q} and Hkv={n_kv}. Try setting enable_gqa=True for GQA."
        )
    window = list(window_size)
    if window not in ([-1, -1], [-1, 0]):
        raise NotImplementedError(f"the reference covers full and causal windows, got {window}")
    return _attend(query, key, value, cu_seq_q, window == [-1, 0], scale, n_q // n_kv)


def varlen_attn_2_10(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None
):
    """``varlen_attn`` as of torch 2.10-2.11: ``[T, H, D]`` out, no GQA argument."""
    _check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    if return_aux is not None:
        raise NotImplementedError("the reference covers training attention only")
    if query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query has {query.shape[1]} heads, key/value {key.shape[1]}: this signature has no GQA"
        )
    return _attend(query, key, value, cu_seq_q, is_causal, None, 1)
