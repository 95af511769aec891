"""RoPE math shared by every family: fp32 frequencies, exact cos/sin, checked apply.

`inv_freq` is computed in fp32 exactly as upstream does (so both round alike), angles stay
exact beyond fp32's integer range, and `apply_rotary_pos_emb` (the HF-named drop-in for
InternLM2's) checks its inputs and rotates in fp32 whatever the input dtype.
"""

import contextlib

import torch
from torch.autograd.function import once_differentiable

from xtuner_rope.ops.positions import check_position_ids
from xtuner_rope.ops.rope_triton import triton_apply, triton_apply_active, use_triton_apply
from xtuner_rope.ops.rotate import rotate_heads, use_fused_apply

__all__ = [
    "FP32_EXACT_POSITIONS",
    "apply_rotary_pos_emb",
    "check_position_ids",
    "cos_sin",
    "cos_sin_at",
    "inv_freq",
    "no_autocast",
    "rotate_half",
    "use_fused_apply",
    "use_triton_apply",
]


def no_autocast(device):
    """Autocast off on `device` (where it exists): angles are computed in fp32."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def inv_freq(base, dim, device=None):
    """fp32 inverse frequencies `[h_d/2]`, written as upstream does so both round alike."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (base**exponents)


def cos_sin(positions, inv_freq):
    """cos and sin `[..., h_d]` for float `positions` `[...]` and `inv_freq` `[h_d/2]`."""
    with no_autocast(positions.device):
        # One rounding per angle (fp32: like the reference's outer product).
        freqs = positions[..., None] * inv_freq  # [..., h_d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., h_d]
        return emb.cos(), emb.sin()


# fp32 holds every integer below 2**24, not all above (2**24 + 1 rounds to 2**24).
FP32_EXACT_POSITIONS = 1 << 24


def cos_sin_at(position_ids, inv_freq, hi, divisor=None):
    """fp32 cos and sin `[..., h_d]` at integer `position_ids` `[...]` whose max is `hi`, from fp32
    `inv_freq` `[h_d/2]` (positions divided by `divisor` first: linear scaling).

    Below `FP32_EXACT_POSITIONS` the angles are fp32, as the reference computes them; beyond, fp32
    cannot hold every position, so they are computed in fp64 from the same `inv_freq`.
    """
    dtype = torch.float32 if hi < FP32_EXACT_POSITIONS else torch.float64
    positions = position_ids.to(dtype)
    if divisor is not None:
        positions = positions / divisor  # the reference divides first
    cos, sin = cos_sin(positions, inv_freq.to(dtype))
    return cos.float(), sin.float()


def rotate_half(x):
    """Rotate half the hidden dims: `[x1, x2] -> [-x2, x1]` on the last dim `h_d`."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class _ApplyRotary(torch.autograd.Function):
    """Rotate q and k in fp32; saves only cos/sin, the backward applies the transpose."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim, ctx.interleaved = unsqueeze_dim, interleaved
        return tuple(rotate_heads(x, cos, sin, unsqueeze_dim, False, interleaved) for x in (q, k))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        # The map is linear in q (and k): its vector-Jacobian product is its transpose.
        grads = [
            rotate_heads(g, cos, sin, ctx.unsqueeze_dim, True, ctx.interleaved) if needs else None
            for g, needs in zip((grad_q, grad_k), ctx.needs_input_grad)
        ]
        return *grads, None, None, None, None


def _table_rows(cos, sin, q, position_ids, unsqueeze_dim):
    """Pick rows of `[L, h_d]` tables (older remote code) as `[b, s, h_d]` cos/sin."""
    seq_len = q.shape[2 if unsqueeze_dim == 1 else 1]  # q is [b, n_h, s, h_d] or [b, s, n_h, h_d]
    if position_ids is None:
        position_ids = torch.arange(seq_len)[None]  # [1, s]
    desc = f"rows of the {cos.shape[0]}-row cos/sin table"
    check_position_ids(
        position_ids,
        q.shape[0],
        seq_len,
        cos.shape[0],
        desc,
        "get longer tables from the rotary embedding (larger seq_len)",
    )
    position_ids = position_ids.to(cos.device).long()
    return cos[position_ids], sin[position_ids]  # [b, s, h_d]


def _check_apply_inputs(q, k, cos, sin, unsqueeze_dim):
    """Types and shapes of `apply_rotary_pos_emb`'s inputs; shape reads only (no device sync)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(
                f"apply_rotary_pos_emb: {name} must be a floating-point tensor, got "
                f"{got}; pass the rotary embedding's cos/sin and the projected q/k"
            )
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"apply_rotary_pos_emb: expected 4-D q/k with the heads at "
            f"unsqueeze_dim 1 ([b, n_h, s, h_d]) or 2 ([b, s, n_h, h_d]), got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, unsqueeze_dim={unsqueeze_dim!r}"
        )
    head_dim, s_dim = q.shape[-1], 3 - unsqueeze_dim
    b, s = q.shape[0], q.shape[s_dim]
    rot = cos.shape[-1]
    if head_dim % 2 or k.shape[-1] != head_dim or rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(
            f"apply_rotary_pos_emb needs one even head dim h_d, got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}; cos/sin "
            f"cover h_d, or an even rotary dim < h_d (partial rotary: the first dims rotate)"
        )
    if k.shape[0] != b or k.shape[s_dim] != s:
        raise ValueError(
            f"apply_rotary_pos_emb: k {tuple(k.shape)} must have the batch {b} and "
            f"sequence length {s} of q {tuple(q.shape)}"
        )
    if sin.shape != cos.shape:
        raise ValueError(
            f"apply_rotary_pos_emb: sin {tuple(sin.shape)} must have the shape of "
            f"cos {tuple(cos.shape)}"
        )
    if cos.dim() == 3 and (cos.shape[0] not in (1, b) or cos.shape[1] != s):
        raise ValueError(
            f"apply_rotary_pos_emb: cos/sin {tuple(cos.shape)} do not match q "
            f"{tuple(q.shape)}: expected [1, {s}, {rot}] or [{b}, {s}, "
            f"{rot}] (one row per token); compute them from these position_ids"
        )
    if cos.dim() not in (2, 3):
        raise ValueError(
            f"apply_rotary_pos_emb: cos/sin must be [b, s, h_d] or [L, h_d] "
            f"tables, got {tuple(cos.shape)}"
        )


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, interleaved=False):
    """Apply rotary position embedding to q and k; arithmetic in fp32 whatever the dtypes.

    On CUDA one Triton kernel rotates q and k (`ops.rope_triton`); elsewhere the eager kernel of
    `ops.rotate` (or its `torch.compile` version, `use_fused_apply`). No gradient into cos/sin.

    Args:
        q (torch.Tensor): Queries `[b, n_h, s, h_d]` (`[b, s, n_h, h_d]` with unsqueeze_dim=2).
        k (torch.Tensor): Keys `[b, n_kv, s, h_d]` (or `[b, s, n_kv, h_d]`).
        cos (torch.Tensor): `[b, s, rot]`, or `[L, rot]` tables of older remote code (rows picked
            by position_ids, 0..s-1 when None); rot is h_d, or an even dim < h_d (partial rotary).
        sin (torch.Tensor): Same shape as cos.
        position_ids (torch.Tensor, optional): `[b, s]`; only used with `[L, rot]` tables.
        unsqueeze_dim (int): Heads dim of q/k.
        interleaved (bool): Rotate the pairs (2i, 2i + 1) (Cohere) instead of (i, i + rot/2).

    Returns:
        tuple[torch.Tensor, torch.Tensor]: Rotated q and k in their own dtypes.

    Raises:
        TypeError: q, k, cos or sin not a floating-point tensor.
        ValueError: Odd or mismatched head dims, a rotary dim beyond h_d, mismatched batch or
            length, bad position ids for `[L, rot]` tables.
    """
    _check_apply_inputs(q, k, cos, sin, unsqueeze_dim)
    if cos.dim() == 2:
        cos, sin = _table_rows(cos, sin, q, position_ids, unsqueeze_dim)
    cos, sin = cos.float(), sin.float()  # [b, s, rot]
    if triton_apply_active(q):
        rotated = triton_apply(q, k, cos, sin, unsqueeze_dim, interleaved)
        if rotated is not None:  # None: the kernel failed on CUDA and warned
            return rotated
    return _ApplyRotary.apply(q, k, cos, sin, unsqueeze_dim, bool(interleaved))
