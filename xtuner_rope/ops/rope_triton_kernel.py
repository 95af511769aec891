"""The Triton RoPE kernel: q and k of a block of tokens rotated in one program, fp32 in registers.

Imported lazily by `ops.rope_triton` (`triton.jit` picks interpreter or compiler then); Triton
3.0-era language only. Pairs dim `i_1` with `i_2` (`d + HALF`, or `2d, 2d + 1` with
`INTERLEAVED`): `out_1 = x_1 cos_1 - x_2 sin_1`, `out_2 = x_2 cos_2 + x_1 sin_2`; `TRANSPOSE` is
the backward; the `PASS` dims after the first `2 * HALF` (partial rotary) are copied.
"""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x,
    out,
    n,
    x_sb,
    x_ss,
    x_sn,
    x_sd,
    o_sb,
    o_ss,
    o_sn,
    o_sd,
    bi,
    si,
    tok,
    c_1,
    c_2,
    s_1,
    s_2,
    i_1,
    i_2,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Rotate the `n` heads of tokens (bi, si) `[BLOCK_S, 1, 1]` of x `[b, s, n, h_d]` (any
    strides) into out, pairing dims `i_1` and `i_2` `[1, 1, BLOCK_HALF]`; `tok` `[BLOCK_S, 1, 1]`
    masks the tokens past the end."""
    # int64: h * x_sn overflows int32 past 2**31 elements (540k tokens x 32 heads of 128 dims
    # in the [b, n, s, h_d] layout), as t's offsets do in rope_kernel.
    h = tl.arange(0, BLOCK_N)[None, :, None].to(tl.int64)  # [1, BLOCK_N, 1] heads
    d = tl.arange(0, BLOCK_HALF)[None, None, :]  # [1, 1, BLOCK_HALF] dims of one half
    mask = tok & (h < n) & (d < HALF)
    src = x + bi * x_sb + si * x_ss + h * x_sn
    dst = out + bi * o_sb + si * o_ss + h * o_sn
    x_1 = tl.load(src + i_1 * x_sd, mask=mask, other=0.0).to(tl.float32)
    x_2 = tl.load(src + i_2 * x_sd, mask=mask, other=0.0).to(tl.float32)
    out_1 = x_1 * c_1 - x_2 * s_1
    out_2 = x_2 * c_2 + x_1 * s_2
    tl.store(dst + i_1 * o_sd, out_1.to(out.dtype.element_ty), mask=mask)
    tl.store(dst + i_2 * o_sd, out_2.to(out.dtype.element_ty), mask=mask)
    if PASS > 0:  # partial rotary: the dims past the rotary ones pass through
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, None, :]  # [1, 1, BLOCK_PASS]
        keep = tok & (h < n) & (p < 2 * HALF + PASS)
        tl.store(dst + p * o_sd, tl.load(src + p * x_sd, mask=keep, other=0.0), mask=keep)


@triton.jit
def rope_kernel(
    q,
    k,
    q_out,
    k_out,
    cos,
    sin,
    n_tokens,
    s,
    n_q,
    n_k,
    q_sb,
    q_ss,
    q_sn,
    q_sd,
    k_sb,
    k_ss,
    k_sn,
    k_sd,
    qo_sb,
    qo_ss,
    qo_sn,
    qo_sd,
    ko_sb,
    ko_ss,
    ko_sn,
    ko_sd,
    c_sb,
    c_ss,
    c_sd,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """One program per `BLOCK_S` tokens (grid `[cdiv(b * s, BLOCK_S)]`): their q heads and k
    heads, one cos/sin row per token.

    q, k: `[b, s, n_q | n_k, h_d]` by strides (heads-first tensors come as strided views);
    cos, sin: fp32 `[b or 1, s, 2 * HALF]` by strides (`c_sb` = 0 broadcasts one row).
    """
    # int64: offsets of large tensors overflow int32.
    t = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None, None]
    tok = t < n_tokens  # [BLOCK_S, 1, 1]
    bi = t // s
    si = t % s
    d = tl.arange(0, BLOCK_HALF)[None, None, :]  # [1, 1, BLOCK_HALF]
    dmask = tok & (d < HALF)
    if INTERLEAVED:  # pairs (2d, 2d + 1)
        i_1 = 2 * d
        i_2 = 2 * d + 1
    else:  # rotate_half: pairs (d, d + HALF)
        i_1 = d
        i_2 = d + HALF
    c_row = cos + bi * c_sb + si * c_ss
    s_row = sin + bi * c_sb + si * c_ss
    c_1 = tl.load(c_row + i_1 * c_sd, mask=dmask, other=0.0)
    c_2 = tl.load(c_row + i_2 * c_sd, mask=dmask, other=0.0)
    s_1 = tl.load(s_row + i_1 * c_sd, mask=dmask, other=0.0)
    s_2 = tl.load(s_row + i_2 * c_sd, mask=dmask, other=0.0)
    if TRANSPOSE:  # the transpose: out_1 = x_1 cos_1 + x_2 sin_2, out_2 = x_2 cos_2 - x_1 sin_1
        s_t = s_1
        s_1 = -s_2
        s_2 = -s_t
    _rotate_heads(
        q, q_out, n_q, q_sb, q_ss, q_sn, q_sd, qo_sb, qo_ss, qo_sn, qo_sd, bi, si, tok,
        c_1, c_2, s_1, s_2, i_1, i_2, HALF, PASS, BLOCK_Q, BLOCK_HALF, BLOCK_PASS,
    )  # fmt: skip
    _rotate_heads(
        k, k_out, n_k, k_sb, k_ss, k_sn, k_sd, ko_sb, ko_ss, ko_sn, ko_sd, bi, si, tok,
        c_1, c_2, s_1, s_2, i_1, i_2, HALF, PASS, BLOCK_K, BLOCK_HALF, BLOCK_PASS,
    )  # fmt: skip


@triton.jit
def copy_kernel(x, out, n, BLOCK: tl.constexpr):
    """`out[:n] = x[:n]` in one program: the probe of the interpreter's loads and stores
    (`ops.rope_triton.interpreter_fault`)."""
    i = tl.arange(0, BLOCK)  # [BLOCK]
    tl.store(out + i, tl.load(x + i, mask=i < n, other=0.0), mask=i < n)
