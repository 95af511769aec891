"""The rotation kernels behind `rope.apply_rotary_pos_emb`: eager (default) and fused.

Both compute `x * cos + rotate_half(x) * sin` (or its transpose, the backward) in fp32 and
return x's dtype: eager over cache-sized chunks, or the opt-in fused `torch.compile` loop (falls
back to eager with a warning). Torch only.
"""

import itertools
import warnings

import torch

# Elements of x rotated per chunk by the eager kernel, so that the chunk stays in cache between
# its passes (2 CPU threads, fp32: ~2.4x the time of a clone; ~3x with whole-tensor passes).
_CHUNK_ELEMENTS = 1 << 19
# The fused kernel: off, or the compiled function (None until the first call compiles it), and
# how many `rotate` calls it served (the public answer to "did the compiled kernel run?").
_fused = {"enabled": False, "fn": None, "calls": 0}


def rotate_eager(x, cos, sin, transpose):
    """Rotate x `[..., h_d]` (any dtype and strides) in fp32: `x * cos + rotate_half(x) * sin`,
    or its transpose (the backward). Returns x's dtype (and strides where x is dense)."""
    # Chunks along x's outermost dim in memory (heads for [b, n, s, h_d], s for the transposed
    # views InternLM2 passes) are compact blocks, which stay in cache across the passes below.
    # On accelerators one chunk: there each chunk costs kernel launches, not cache misses.
    dim = max((d for d in range(x.dim() - 1) if x.shape[d] > 1), key=x.stride, default=0)
    step = max(1, _CHUNK_ELEMENTS * x.shape[dim] // max(x.numel(), 1))
    step = step if x.device.type == "cpu" else max(x.shape[dim], 1)

    def chunks(t):  # t's pieces matching x's chunks, or t itself where it broadcasts
        return t.split(step, dim) if t.shape[dim] > 1 else itertools.repeat(t)

    sin_1, sin_2 = sin.chunk(2, dim=-1)  # [..., h_d/2] each
    # out_1 += x_2 * w_1 and out_2 += x_1 * w_2: the rotate_half terms, without the cat.
    w_1, w_2, v_1 = (sin_2, sin_1, 1.0) if transpose else (sin_1, sin_2, -1.0)
    out, scratch = torch.empty_like(x), None
    for x_c, out_c, cos_c, w_1c, w_2c in zip(
        x.split(step, dim), out.split(step, dim), chunks(cos), chunks(w_1), chunks(w_2)
    ):
        src, acc = x_c, out_c
        if x.dtype != torch.float32:
            # Ops mixing bf16/fp16 with fp32 take a slow scalar path on CPU: upcast the chunk
            # into reused fp32 scratch instead, and round once at the end.
            if scratch is None:  # in x_c's memory layout, so that the copies stream
                scratch = [torch.empty_like(x_c, dtype=torch.float32) for _ in range(2)]
            src, acc = (t.narrow(dim, 0, x_c.shape[dim]) for t in scratch)
            src.copy_(x_c)
        torch.mul(src, cos_c, out=acc)  # whole rows: long contiguous runs, unlike halves
        (x_1, x_2), (a_1, a_2) = src.chunk(2, dim=-1), acc.chunk(2, dim=-1)
        a_1.addcmul_(x_2, w_1c, value=v_1)
        a_2.addcmul_(x_1, w_2c, value=-v_1)
        if acc is not out_c:
            out_c.copy_(acc)
    return out


def _rotate_fp32(x, cos, sin, transpose: bool):
    """The rotation as one expression for torch.compile to fuse; shapes as in `rotate_eager`."""
    h = x.shape[-1] // 2
    x_f = x.float()
    x_1, x_2 = x_f[..., :h], x_f[..., h:]  # [..., h_d/2] each
    cos_1, cos_2, sin_1, sin_2 = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    if transpose:
        out = torch.cat((x_1 * cos_1 + x_2 * sin_2, x_2 * cos_2 - x_1 * sin_1), dim=-1)
    else:
        out = torch.cat((x_1 * cos_1 - x_2 * sin_1, x_2 * cos_2 + x_1 * sin_2), dim=-1)
    return out.to(x.dtype)


def use_fused_apply(enabled=True):
    """Turn the fused (torch.compile) rotation kernel on or off for this process; returns whether
    it was on before."""
    before = _fused["enabled"]
    _fused["enabled"] = bool(enabled)
    return before


def fused_kernel_calls():
    """How many `rotate` calls in this process the compiled (fused) kernel served (not fall-backs,
    not calls traced into the user's compiled model): tests and benchmarks read it."""
    return _fused["calls"]


def _rotate_fused(x, cos, sin, transpose):
    if torch.compiler.is_compiling():  # inside a compiled model: let its compiler fuse this
        return _rotate_fp32(x, cos, sin, transpose)
    if _fused["fn"] is None:
        # The head dim stays static (the loop vectorises over it); batch, heads and sequence
        # are marked dynamic below, so new lengths reuse the kernel instead of recompiling.
        _fused["fn"] = torch.compile(_rotate_fp32, dynamic=False)
    for t in (x, cos, sin):
        for d in range(t.dim() - 1):
            torch._dynamo.maybe_mark_dynamic(t, d)
    return _fused["fn"](x, cos, sin, transpose)


def rotate(x, cos, sin, transpose):
    """Rotate x `[..., h_d]` (q, k or a gradient, any dtype and strides) in fp32 with the kernel
    `use_fused_apply` chose; cos, sin fp32 broadcasting against x; `transpose` applies the
    transpose (the backward). Returns x's dtype.
    """
    if _fused["enabled"]:
        try:
            out = _rotate_fused(x, cos, sin, transpose)
        except Exception as error:  # noqa: BLE001 - any compile failure: keep training, eagerly
            _fused["enabled"] = False
            warnings.warn(
                f"xtuner_rope: the fused RoPE kernel failed to compile or run on "
                f"{x.device.type} ({type(error).__name__}: {str(error)[:300]}); using "
                "the eager kernel from now on (call use_fused_apply(False) to silence "
                "this).",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            if not torch.compiler.is_compiling():
                _fused["calls"] += 1
            return out
    return rotate_eager(x, cos, sin, transpose)


def pairs_to_halves(x, rot):
    """`[..., h_d]` with its first rot dims reordered from pairs (2i, 2i + 1) to halves."""
    return torch.cat((x[..., 0:rot:2], x[..., 1:rot:2], x[..., rot:]), dim=-1)


def halves_to_pairs(x, rot):
    """The inverse of `pairs_to_halves`: halves of the first rot dims back to pairs."""
    half = rot // 2
    pairs = torch.stack((x[..., :half], x[..., half:rot]), dim=-1).flatten(-2)  # [..., rot]
    return torch.cat((pairs, x[..., rot:]), dim=-1)


def rotate_heads(x, cos, sin, unsqueeze_dim, transpose, interleaved=False):
    """Rotate the heads of q, k or a gradient ``x`` (or apply the transpose) with `rotate`.

    Args:
        x (torch.Tensor): `[b, n, s, h_d]` (unsqueeze_dim 1) or `[b, s, n, h_d]` (2).
        cos, sin (torch.Tensor): fp32 `[b or 1, s, rot]`, rot even and <= h_d (partial rotary).
        interleaved (bool): Rotate the pairs (2i, 2i + 1) (Cohere) instead of (i, i + rot/2).

    Returns:
        torch.Tensor: x rotated, in x's dtype.
    """
    rot = cos.shape[-1]
    if interleaved:  # pairs gathered into halves, rotated, put back
        x, cos, sin = (pairs_to_halves(t, rot) for t in (x, cos, sin))
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)  # [b, 1, s, rot] (1)
    if rot == x.shape[-1]:
        out = rotate(x, cos, sin, transpose)
    else:  # partial rotary: the first rot dims rotate, the rest pass through
        out = torch.cat((rotate(x[..., :rot], cos, sin, transpose), x[..., rot:]), dim=-1)
    return halves_to_pairs(out, rot) if interleaved else out
