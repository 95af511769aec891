"""Family-free packed attention: each document of a packed row attends only to itself.

Backends (:func:`packed_backend`): flash-attn's varlen kernel (CUDA, fp16/bf16); torch's
``varlen_attn`` (torch >= 2.10); else SDPA (or eager softmax) over the documents re-padded into
length buckets (``ops.document_plan``): no ``[s, s]`` mask.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from xtuner_rope.ops.document_plan import (  # noqa: F401 - the plan's names, as before
    MIN_BUCKET,
    DocumentPlan,
    document_plan,
    plan_documents,
)

HALF_DTYPES = (torch.float16, torch.bfloat16)  # what the fused varlen kernels accept


@dataclass(frozen=True)
class VarlenKernel:
    """A kernel with the contract of ``torch.nn.attention.varlen.varlen_attn`` (either signature)
    and the device types it runs on."""

    fn: Callable
    device_types: tuple[str, ...] = ("cuda",)


# The seam of the varlen backend: None means torch's own ``varlen_attn``. Tests set it (e.g.
# ``monkeypatch.setattr(attention, "VARLEN_KERNEL", VarlenKernel(ref, ("cpu",)))``) to run the
# glue on CPU against a pure-torch kernel with the same contract (tests/varlen_reference.py).
VARLEN_KERNEL: VarlenKernel | None = None


def varlen_kernel() -> VarlenKernel | None:
    """``VARLEN_KERNEL`` if set, else torch's ``varlen_attn`` (torch >= 2.10), else None."""
    if VARLEN_KERNEL is not None:
        return VARLEN_KERNEL
    return _torch_varlen_kernel()


@functools.cache
def _torch_varlen_kernel() -> VarlenKernel | None:
    """torch's own ``varlen_attn``, looked up once per process (every layer asks)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return VarlenKernel(varlen_attn)


def packed_backend(q: torch.Tensor, eager: bool) -> str:
    """The packed backend for ``q``: ``'flash'`` (flash-attn, CUDA, fp16/bf16), else ``'varlen'``
    (``varlen_kernel()``), else ``'eager'`` or ``'sdpa'`` (length buckets) as the dense kernel is.
    """
    half = q.dtype in HALF_DTYPES
    kernel = varlen_kernel() if half else None
    if q.is_cuda and half and _flash_attn_installed():
        backend = "flash"
    elif kernel is not None and q.device.type in kernel.device_types:
        backend = "varlen"
    else:
        backend = "eager" if eager else "sdpa"
    return backend


@functools.cache
def _flash_attn_installed() -> bool:
    """Whether flash-attn is importable: looked up once per process, not per layer call."""
    from importlib.util import find_spec

    return find_spec("flash_attn") is not None


# The parameter names of each varlen kernel seen, so a layer's call is a dictionary lookup.
_KERNEL_PARAMS: dict[Callable, frozenset[str]] = {}


def _kernel_params(fn: Callable) -> frozenset[str]:
    params = _KERNEL_PARAMS.get(fn)
    if params is None:
        params = _KERNEL_PARAMS[fn] = frozenset(inspect.signature(fn).parameters)
    return params


def _varlen_attention(q_t, k_t, v_t, plan: DocumentPlan, fn: Callable) -> torch.Tensor:
    """Causal attention per document of ``q_t [t, n_h, h_d]`` over ``k_t, v_t [t, n_kv, h_d]``
    through a kernel with ``varlen_attn``'s contract; ``[t, n_h, h_d]`` out."""
    params = _kernel_params(fn)
    kwargs = {}
    if "window_size" in params:  # torch >= 2.12; a tuple: some releases compare with (-1, 0)
        kwargs["window_size"] = (-1, 0)
    else:  # torch 2.10-2.11
        kwargs["is_causal"] = True
    n_rep = q_t.shape[1] // k_t.shape[1]
    if n_rep > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif n_rep > 1:  # no GQA in this signature: query head h reads kv head h // n_rep
        k_t, v_t = (x.repeat_interleave(n_rep, dim=1) for x in (k_t, v_t))  # [t, n_h, h_d]
    # One cu_seq tensor for both sides: cuDNN's causal path requires the same object.
    cu = plan.cu_seqlens
    return fn(q_t, k_t, v_t, cu, cu, plan.max_seqlen, plan.max_seqlen, **kwargs)


# torch 2.5 added `enable_gqa` to scaled_dot_product_attention (torch 2.4.1: TypeError).
SDPA_HAS_GQA = TorchVersion(torch.__version__) >= (2, 5)  # a Version, not a string compare


def grouped_sdpa(q, k, v, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of ``q [b, n_h, L, h_d]`` over ``k, v [b, n_kv, S, h_d]``:
    query head h reads kv head h // n_rep (``enable_gqa``; on torch 2.4, which lacks it, the kv
    heads are repeated first, InternLM2's ``repeat_kv`` grouping). ``kwargs`` go to SDPA."""
    n_rep = q.shape[-3] // k.shape[-3]
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=n_rep > 1, **kwargs)
    k = k.repeat_interleave(n_rep, dim=-3)  # [b, n_h, S, h_d]
    v = v.repeat_interleave(n_rep, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _bucket_attention(q, k, v, causal_softmax: bool) -> torch.Tensor:
    """Causal attention of ``q [n, n_h, L, h_d]`` over ``k, v [n, n_kv, L, h_d]``."""
    n_rep = q.shape[1] // k.shape[1]
    if not causal_softmax:
        return grouped_sdpa(q, k, v, is_causal=True)
    k = k.repeat_interleave(n_rep, dim=1)  # [n, n_h, L, h_d], InternLM2's repeat_kv grouping
    v = v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [n, n_h, L, L]
    future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # fp32 as upstream
    return probs @ v


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DocumentPlan, backend: str = "sdpa"
) -> torch.Tensor:
    """Causal attention restricted to each document of a packed batch.

    Args:
        q: ``[b, s, n_h, h_d]`` queries (RoPE applied).
        k, v: ``[b, s, n_kv, h_d]`` keys (RoPE applied) and values; ``n_h`` a multiple of ``n_kv``.
        plan: Document layout from ``document_plan`` / ``plan_documents``.
        backend: ``'flash'``, ``'varlen'``, ``'sdpa'`` or ``'eager'`` (:func:`packed_backend`).

    Returns:
        ``[b, s, n_h, h_d]`` attention output, in ``q.dtype``.
    """
    b, s, n_h, h_d = q.shape
    q_t, k_t, v_t = (x.reshape(b * s, x.shape[2], h_d) for x in (q, k, v))  # [t, heads, h_d]
    if backend == "flash":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q_t,
            k_t,
            v_t,
            plan.cu_seqlens,
            plan.cu_seqlens,
            plan.max_seqlen,
            plan.max_seqlen,
            causal=True,
        )
        return out.reshape(b, s, n_h, h_d)
    if backend == "varlen":
        kernel = varlen_kernel()
        if kernel is None:
            raise RuntimeError(
                "packed_attention(backend='varlen') needs torch >= 2.10 "
                f"(torch.nn.attention.varlen); this is torch {torch.__version__}: "
                "use backend='sdpa'."
            )
        return _varlen_attention(q_t, k_t, v_t, plan, kernel.fn).reshape(b, s, n_h, h_d)
    pieces = []
    for bucket in plan.buckets:
        # [n, L, heads, h_d] -> [n, heads, L, h_d]
        qb, kb, vb = (x[bucket.gather].transpose(1, 2) for x in (q_t, k_t, v_t))
        ob = _bucket_attention(qb, kb, vb, causal_softmax=backend == "eager")
        ob = ob.transpose(1, 2).reshape(-1, n_h, h_d)  # [n * L, n_h, h_d]
        pieces.append(ob[bucket.keep])  # [n_real, n_h, h_d]
    out = torch.cat(pieces)[plan.inverse]  # [t, n_h, h_d] back in token order
    return out.reshape(b, s, n_h, h_d)
