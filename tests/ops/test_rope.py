"""Tests for xtuner_rope/ops/rope.py and models/internlm2_rope.py against XTuner 0.2.0's InternLM2."""

import math

import pytest
import torch
from torch import nn
from xtuner._lite.modelings.internlm2 import modeling_internlm2 as upstream

from xtuner_rope.models.internlm2_rope import ValidatedRotaryEmbedding
from xtuner_rope.ops import rotate
from xtuner_rope.ops.rope import (
    FP32_EXACT_POSITIONS,
    apply_rotary_pos_emb,
    cos_sin_at,
    rotate_half,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Per kind: (max_position_embeddings, scaling_factor). Dynamic gets a small context so that
# the offset mode and s=33 take the NTK branch; linear allows 40 x 2 = 80 positions.
KINDS = {None: (128, 1.0), "linear": (40, 2.0), "dynamic": (16, 2.0)}
UPSTREAM = {
    None: upstream.InternLM2RotaryEmbedding,
    "linear": upstream.InternLM2LinearScalingRotaryEmbedding,
    "dynamic": upstream.InternLM2DynamicNTKScalingRotaryEmbedding,
}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def tol(dtype):
    """Tolerances for our result against an fp32 reference."""
    if dtype == torch.float32:
        return dict(atol=1e-6, rtol=1e-6)
    return dict(atol=1e-5, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-3)


def pair(kind, dim, base=10000):
    """A fresh upstream rotary module and ours, same configuration."""
    max_pos, factor = KINDS[kind]
    ref = UPSTREAM[kind](dim, max_position_embeddings=max_pos, base=base, scaling_factor=factor)
    return ref, ValidatedRotaryEmbedding(dim, max_pos, base, kind, factor)


def positions(mode, b, s):
    """Position ids `[b, s]` (None for mode 'none') as the model would see them."""
    if mode == "none":
        return None
    if mode == "expanded":
        return torch.arange(s)[None].expand(b, s)
    if mode == "offset":  # decoding: the new tokens come after 37 cached ones
        return torch.arange(37, 37 + s)[None].expand(b, s)
    # 'packed': documents of 5, 3 and 10 tokens, positions restart at each one
    docs = [torch.arange(n) for n in [5, 3, 10] * (s // 18 + 1)]
    return torch.cat(docs)[:s][None].expand(b, s)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("head_dim,seq_len", [(8, 1), (64, 7), (128, 33)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["none", "expanded", "packed", "offset"])
def test_rotary_matches_upstream(kind, head_dim, seq_len, dtype, mode):
    ref, ours = pair(kind, head_dim)
    x = randn(2, 3, seq_len, head_dim, dtype=dtype)  # value_states [b, n_kv, s, h_d]
    pos = positions(mode, 2, seq_len)
    ref_pos = torch.arange(seq_len)[None] if pos is None else pos
    cos, sin = ours(x, pos)  # positional, as InternLM2 calls it
    ref_cos, ref_sin = ref(x, ref_pos)
    assert cos.dtype == dtype and cos.shape == ref_cos.shape
    torch.testing.assert_close(cos, ref_cos, **tol(dtype))
    torch.testing.assert_close(sin, ref_sin, **tol(dtype))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("seq_len", [1, 9, 33])
def test_rotary_seq_len_signature_matches_upstream(kind, seq_len):
    # Old remote code: rotary_emb(x, seq_len=N) gives [N, h_d] rows for positions 0..N-1,
    # which the current upstream class computes for position_ids = arange(N).
    ref, ours = pair(kind, 64)
    x = randn(1, 2, 1, 64)
    ref_cos, ref_sin = ref(x, torch.arange(seq_len)[None])
    cos, sin = ours(x, seq_len=seq_len)
    assert cos.shape == (seq_len, 64)
    torch.testing.assert_close(cos, ref_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours(x, seq_len)[0], cos, atol=0, rtol=0)  # int positionally


def test_rotary_long_positions_match_upstream_in_fp32():
    # Same fp32 formula, one rounding per angle: agreement holds at positions of thousands.
    for kind in KINDS:
        ref = UPSTREAM[kind](128, max_position_embeddings=2048, scaling_factor=2.0)
        ours = ValidatedRotaryEmbedding(128, 2048, scaling_type=kind, scaling_factor=2.0)
        pos = torch.arange(4000, 4095)[None] if kind else torch.arange(1950, 2048)[None]
        x = randn(1, 1, pos.shape[1], 128)
        torch.testing.assert_close(ours(x, pos), ref(x, pos), atol=1e-6, rtol=0)


def test_rotary_outputs_carry_no_grad():
    ours = ValidatedRotaryEmbedding(8, 16)
    cos, sin = ours(randn(1, 1, 4, 8).requires_grad_())
    assert not cos.requires_grad and not sin.requires_grad


def test_bf16_cast_keeps_inv_freq_fp32_and_cos_accurate():
    # module.bfloat16() (DeepSpeed does it) casts upstream's inv_freq to bf16; at position
    # ~4096 its angles are then off by radians. Measure both against fp64 ground truth.
    ref = upstream.InternLM2RotaryEmbedding(128, max_position_embeddings=8192).bfloat16()
    ours = ValidatedRotaryEmbedding(128, 8192).bfloat16()
    pos = torch.arange(4090, 4100)[None]
    x = randn(1, 1, 10, 128)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    freqs = pos[0, :, None].double() * inv_freq
    truth = torch.cat((freqs, freqs), dim=-1).cos()
    ref_error = (ref(x, pos)[0][0].double() - truth).abs().max().item()
    our_error = (ours(x, pos)[0][0].double() - truth).abs().max().item()
    assert ref.inv_freq.dtype == torch.bfloat16 and ours.inv_freq.dtype == torch.float32
    assert ref_error > 0.1, ref_error
    assert our_error < 1e-3, our_error


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.to(torch.float16),
        lambda m: m.to("cpu"),
        lambda m: nn.Sequential(m).bfloat16()[0],
    ],
    ids=["half", "bfloat16", "to_fp16", "to_cpu", "parent_bfloat16"],
)
def test_inv_freq_stays_fp32(cast):
    fresh = ValidatedRotaryEmbedding(64, 128, base=500000)
    moved = cast(ValidatedRotaryEmbedding(64, 128, base=500000))
    assert moved.inv_freq.dtype == torch.float32
    torch.testing.assert_close(moved.inv_freq, fresh.inv_freq, atol=0, rtol=0)
    assert "inv_freq" not in moved.state_dict()


def test_dynamic_ntk_is_stateless():
    # Upstream (xtuner 0.2.0) overwrites inv_freq for good after one long sequence.
    x_long, x_short = randn(1, 1, 64, 32), randn(1, 1, 8, 32)
    long_pos, short_pos = torch.arange(64)[None], torch.arange(8)[None]
    ref, ours = pair("dynamic", 32)
    ref_fresh, ours_fresh = pair("dynamic", 32)
    ref(x_long, long_pos)
    ours(x_long, long_pos)
    assert not torch.allclose(ref(x_short, short_pos)[0], ref_fresh(x_short, short_pos)[0])
    torch.testing.assert_close(
        ours(x_short, short_pos), ours_fresh(x_short, short_pos), atol=0, rtol=0
    )
    torch.testing.assert_close(ours.inv_freq, ours_fresh.inv_freq, atol=0, rtol=0)


def test_table_grows_to_powers_of_two_from_positions():
    ours = ValidatedRotaryEmbedding(8, 4096, base=1234.5)  # a base no other test uses
    ours(randn(1, 1, 6, 8), torch.arange(6)[None])  # max position 5
    assert ours.table_length("cpu") == 8
    ours(randn(1, 1, 101, 8), torch.arange(101)[None])  # max position 100
    assert ours.table_length("cpu") == 128
    ours(randn(1, 1, 2, 8))
    assert ours.table_length("cpu") == 128  # never shrinks
    ours(randn(1, 1, 3, 8), torch.arange(1000, 1003)[None])  # from positions, not from s
    assert ours.table_length("cpu") == 1024


def test_tables_shared_between_layers():
    first, second = (ValidatedRotaryEmbedding(8, 64, base=4321.0) for _ in range(2))
    first(randn(1, 1, 40, 8))
    assert second.table_length("cpu") == 64


def test_tables_built_in_inference_mode_serve_training():
    rotary = ValidatedRotaryEmbedding(8, 16, base=777.0)  # fresh shared tables
    with torch.inference_mode():
        rotary(randn(1, 1, 4, 8), torch.arange(4)[None])
    q = randn(1, 2, 4, 8).requires_grad_()
    q_out, _ = apply_rotary_pos_emb(q, q, *rotary(q, torch.arange(4)[None]))
    q_out.sum().backward()
    assert q.grad is not None


ERRORS = [
    (lambda: torch.arange(4.0)[None], TypeError, r"position_ids must be an integer tensor"),
    (lambda: [[0, 1, 2, 3]], TypeError, r"position_ids must be a torch.Tensor, got list"),
    (lambda: torch.arange(4)[None, None], ValueError, r"must be 2-D \[b, s\], got shape"),
    (lambda: torch.arange(4)[None].expand(3, 4), ValueError, r"batch 2 and sequence length 4"),
    (lambda: torch.arange(5)[None], ValueError, r"has shape \(1, 5\).*expected \(1, 4\)"),
    (
        lambda: torch.tensor([[0, 1, 2, 3], [0, 1, -3, 2]]),
        ValueError,
        r"non-negative, got -3 at row 1, column 2",
    ),
    (
        lambda: torch.tensor([[0, 1, 16, 17]]),
        ValueError,  # the largest is named
        r"holds 17 at row 0, column 3, beyond .* \[0, 16\) \(max_position_embeddings=16\)",
    ),
]


@pytest.mark.parametrize("make_pos,error,match", ERRORS)
def test_bad_position_ids_raise(make_pos, error, match):
    with pytest.raises(error, match=match):
        ValidatedRotaryEmbedding(8, 16)(randn(2, 1, 4, 8), make_pos())


def test_limit_with_linear_factor_and_override():
    x = randn(1, 1, 1, 8)
    linear = ValidatedRotaryEmbedding(8, 16, scaling_type="linear", scaling_factor=2.0)
    linear(x, torch.tensor([[31]]))
    with pytest.raises(ValueError, match=r"\[0, 32\) \(max_position_embeddings=16 x linear"):
        linear(x, torch.tensor([[32]]))
    override = ValidatedRotaryEmbedding(8, 16, max_position=20)
    override(x, torch.tensor([[19]]))
    with pytest.raises(ValueError, match=r"\[0, 20\) \(max_position=20\)"):
        override(x, torch.tensor([[20]]))
    with pytest.raises(ValueError, match=r"holds 3 .* \[0, 3\) \(max_position=3\)"):
        dynamic = ValidatedRotaryEmbedding(8, 16, scaling_type="dynamic", max_position=3)
        dynamic(x, torch.tensor([[3]]))


def test_dynamic_is_unbounded():
    ours = ValidatedRotaryEmbedding(8, 16, scaling_type="dynamic", scaling_factor=2.0)
    cos, _ = ours(randn(1, 1, 1, 8), torch.tensor([[10**6]]))
    assert torch.isfinite(cos).all()


def float64_cos_sin(position_ids, inv_freq):
    """cos, sin ``[..., h_d]`` with every angle in float64 from the same fp32 ``inv_freq``."""
    angles = position_ids[..., None].double() * inv_freq.double()  # [..., h_d/2]
    angles = torch.cat((angles, angles), dim=-1)  # [..., h_d]
    return angles.cos(), angles.sin()


# Beyond 2**24, where fp32 stops holding every integer (2**24 + 1 rounds to 2**24).
HUGE = torch.tensor(
    [
        [
            FP32_EXACT_POSITIONS - 1,
            FP32_EXACT_POSITIONS + 1,
            FP32_EXACT_POSITIONS + 3,
            2 * FP32_EXACT_POSITIONS + 7,
            5,
        ]
    ]
)


def test_dynamic_ntk_beyond_fp32_exact_positions_matches_float64():
    ours = ValidatedRotaryEmbedding(8, 16, scaling_type="dynamic", scaling_factor=2.0)
    cos, sin = ours(torch.zeros(1, 1, 5, 8), HUGE)
    inv_freq = ours._ntk_inv_freq(int(HUGE.max()) + 1, HUGE.device)
    ref_cos, ref_sin = float64_cos_sin(HUGE[0], inv_freq)
    torch.testing.assert_close(
        (cos[0].double(), sin[0].double()), (ref_cos, ref_sin), rtol=0, atol=1e-6
    )
    # The check has teeth: fp32 angles (the reference's arithmetic) are off by far more there.
    fp32_cos = torch.cat([HUGE[0, :, None].float() * inv_freq] * 2, dim=-1).cos()
    assert (fp32_cos.double() - ref_cos).abs().max() > 0.5


def test_cos_sin_at_is_the_fp32_arithmetic_below_two_to_the_24():
    inv_freq = ValidatedRotaryEmbedding(8, 16).inv_freq
    positions = torch.tensor([0, 7, 10**6, FP32_EXACT_POSITIONS - 1])
    angles = positions[:, None].float() * inv_freq  # [4, h_d/2], the reference's fp32 product
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = cos_sin_at(positions, inv_freq, int(positions.max()))
    torch.testing.assert_close((cos, sin), (angles.cos(), angles.sin()), rtol=0, atol=0)


def test_implicit_positions_beyond_limit_raise():
    with pytest.raises(ValueError, match=r"holds 16 at row 0, column 16.*\[0, 16\)"):
        ValidatedRotaryEmbedding(8, 16)(randn(1, 1, 17, 8))


@pytest.mark.parametrize(
    "seq_len,error,match",
    [
        (0, ValueError, r"seq_len must be a positive int, got 0"),
        (-2, ValueError, r"seq_len must be a positive int, got -2"),
        (2.0, TypeError, r"seq_len must be a positive int, got float"),
        (17, ValueError, r"seq_len=17 is beyond the supported range of 16 positions"),
    ],
)
def test_bad_seq_len_raises(seq_len, error, match):
    with pytest.raises(error, match=match):
        ValidatedRotaryEmbedding(8, 16)(randn(1, 1, 1, 8), seq_len=seq_len)


def test_position_ids_and_seq_len_together_raise():
    with pytest.raises(ValueError, match=r"pass position_ids or seq_len .* not both"):
        ValidatedRotaryEmbedding(8, 16)(randn(1, 1, 2, 8), torch.arange(2)[None], seq_len=2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dim=7), r"dim \(rotary head dim\) must be a positive even number, got 7"),
        (dict(dim=8, scaling_type="yarn"), r"scaling_type must be None, 'linear' or 'dynamic'"),
        (
            dict(dim=8, scaling_type="linear", scaling_factor=0.0),
            r"scaling_factor must be positive",
        ),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ValidatedRotaryEmbedding(**kwargs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_from_module_keeps_configuration_and_outputs(kind):
    ref, _ = pair(kind, 64, base=50000)
    ours = ValidatedRotaryEmbedding.from_module(ref)
    max_pos, factor = KINDS[kind]
    assert (ours.dim, ours.base, ours.max_position_embeddings) == (64, 50000, max_pos)
    assert (ours.scaling_type, ours.scaling_factor) == (kind, factor)
    assert ours.inv_freq.device == ref.inv_freq.device
    x, pos = randn(1, 2, 33, 64), torch.arange(40, 73)[None]
    torch.testing.assert_close(ours(x, pos), ref(x, pos), atol=1e-6, rtol=0)


def test_from_module_reads_remote_code_copies():
    class RemoteRotary(nn.Module):  # a remote-code class, no 'Linear'/'Dynamic' in its name
        def __init__(self):
            super().__init__()
            self.dim, self.base, self.max_position_embeddings = 16, 1e6, 32
            self.scaling_type, self.scaling_factor = "linear", 4.0
            self.register_buffer("inv_freq", torch.ones(8).bfloat16(), persistent=False)

    ours = ValidatedRotaryEmbedding.from_module(RemoteRotary())
    assert (ours.scaling_type, ours.scaling_factor, ours.base) == ("linear", 4.0, 1e6)
    assert ours.inv_freq.dtype == torch.float32
    with pytest.raises(
        TypeError,
        match=r"expects an InternLM2 rotary embedding, got Linear "
        r"without dim, base, max_position_embeddings",
    ):
        ValidatedRotaryEmbedding.from_module(nn.Linear(2, 2))


def apply_both(q, k, cos, sin, unsqueeze_dim=1):
    """Ours in the inputs' dtype, upstream in fp32; forward outputs and q/k grads of both."""
    grads = randn(*q.shape, dtype=q.dtype, seed=1), randn(*k.shape, dtype=k.dtype, seed=2)
    results = []
    for apply, dtype in (
        (apply_rotary_pos_emb, q.dtype),
        (upstream.apply_rotary_pos_emb, torch.float32),
    ):
        qi, ki = (t.detach().to(dtype).requires_grad_() for t in (q, k))
        q_out, k_out = apply(qi, ki, cos.to(dtype), sin.to(dtype), None, unsqueeze_dim)
        torch.autograd.backward((q_out, k_out), (grads[0].to(dtype), grads[1].to(dtype)))
        results.append((q_out, k_out, qi.grad, ki.grad))
    return results


@pytest.mark.parametrize(
    "b,n_h,n_kv,s,h_d", [(1, 4, 2, 1, 8), (2, 3, 1, 7, 64), (1, 16, 8, 33, 128)]
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_apply_matches_upstream_forward_and_backward(b, n_h, n_kv, s, h_d, dtype, transposed):
    rotary = ValidatedRotaryEmbedding(h_d, 4096)
    if transposed:  # InternLM2 passes [b, s, n, h_d] -> [b, n, s, h_d] views
        q = randn(b, s, n_h, h_d).transpose(1, 2)
        k = randn(b, s, n_kv, h_d, seed=3).transpose(1, 2)
    else:
        q, k = randn(b, n_h, s, h_d), randn(b, n_kv, s, h_d, seed=3)
    q, k = q.to(dtype), k.to(dtype)
    cos, sin = rotary(k, positions("offset", b, s) * 50)  # positions up to ~3500
    ours, ref = apply_both(q, k, cos, sin)
    for mine, theirs in zip(ours, ref):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine, theirs.to(dtype), **tol(dtype))


def test_apply_matches_upstream_for_any_cos_sin():
    # Not only tables from a rotary module: cos/sin whose halves differ follow upstream's
    # formula too, forward and backward.
    q, k = randn(2, 4, 6, 16), randn(2, 2, 6, 16, seed=3)
    cos, sin = randn(2, 6, 16, seed=4), randn(2, 6, 16, seed=5)
    ours, ref = apply_both(q, k, cos, sin)
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine, theirs, **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "batch"])
def test_apply_in_several_chunks(monkeypatch, dtype, layout):
    # 2 rows of the chunked dim per chunk: heads (7 for q, 3 for k), s (5) for the transposed
    # views InternLM2 passes, batch when b > 1; each ends with a partial chunk.
    monkeypatch.setattr(rotate, "_CHUNK_ELEMENTS", 2 * 7 * 16)
    b = 3 if layout == "batch" else 1
    q, k = randn(b, 7, 5, 16).to(dtype), randn(b, 3, 5, 16, seed=3).to(dtype)
    if layout == "transposed":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [b, s, n_h, h_d] in memory
        k = torch.cat((k, k), dim=-1)[..., 8:24].copy_(k)  # a non-dense view
    batch_cos = 1 if layout == "contiguous" else b  # cos broadcast over, or split with, b
    cos, sin = ValidatedRotaryEmbedding(16, 64)(k, positions("packed", batch_cos, 5))
    ours, ref = apply_both(q, k, cos, sin)
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine, theirs.to(dtype), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_unsqueeze_dim_2(dtype):
    q, k = randn(2, 5, 4, 16).to(dtype), randn(2, 5, 2, 16, seed=3).to(dtype)  # [b, s, n, h_d]
    cos, sin = ValidatedRotaryEmbedding(16, 64)(q.transpose(1, 2), positions("packed", 2, 5))
    ours, ref = apply_both(q, k, cos, sin, unsqueeze_dim=2)
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine, theirs.to(dtype), **tol(dtype))


def test_apply_with_old_tables_picks_rows_by_position():
    # Older remote code passes [N, h_d] tables and position_ids to apply_rotary_pos_emb.
    rotary = ValidatedRotaryEmbedding(32, 64)
    q, k = randn(2, 4, 6, 32), randn(2, 2, 6, 32, seed=3)
    pos = positions("packed", 2, 6)
    table_cos, table_sin = rotary(k, seq_len=10)
    cos, sin = rotary(k, pos)
    torch.testing.assert_close(
        apply_rotary_pos_emb(q, k, table_cos, table_sin, pos),
        upstream.apply_rotary_pos_emb(q, k, cos, sin),
        atol=1e-6,
        rtol=0,
    )
    prefix = upstream.apply_rotary_pos_emb(q, k, *rotary(k))
    torch.testing.assert_close(
        apply_rotary_pos_emb(q, k, table_cos, table_sin), prefix, atol=1e-6, rtol=0
    )
    with pytest.raises(ValueError, match=r"holds 10 .* \[0, 10\) \(rows of the 10-row cos/sin"):
        apply_rotary_pos_emb(q, k, table_cos, table_sin, pos + 6)


def test_apply_rejects_odd_or_mismatched_head_dims():
    with pytest.raises(ValueError, match=r"one even head dim h_d, got q \(1, 1, 2, 7\)"):
        x = randn(1, 1, 2, 7)
        apply_rotary_pos_emb(x, x, randn(1, 2, 7), randn(1, 2, 7))


def test_apply_fp16_does_not_overflow_where_the_result_fits():
    # Upstream rounds q*cos and rotate_half(q)*sin to fp16 before adding them: near 65504
    # the sum of two rounded-up products overflows although the exact result fits.
    values = torch.arange(45000, 47500, 32, dtype=torch.float32).half().unique()
    x1, x2 = values.repeat_interleave(len(values)), values.repeat(len(values))
    q = torch.stack((x1, x2), dim=-1)[None, None]  # [1, 1, s, 2]: every pair of values
    angle = torch.full((1, q.shape[2], 1), math.pi / 4)  # [b, s, h_d / 2]
    emb = torch.cat((angle, angle), dim=-1)  # [b, s, h_d]
    cos, sin = emb.cos().half(), emb.sin().half()
    ref, _ = upstream.apply_rotary_pos_emb(q, q, cos, sin)
    ours, _ = apply_rotary_pos_emb(q, q, cos, sin)
    truth, _ = upstream.apply_rotary_pos_emb(q.double(), q.double(), cos.double(), sin.double())
    fits = truth.abs() <= torch.finfo(torch.float16).max
    assert (~torch.isfinite(ref) & fits).any()
    assert torch.isfinite(ours[fits]).all()
    torch.testing.assert_close(ours[fits].double(), truth[fits], atol=0, rtol=1e-3)


def test_rotate_half_matches_upstream():
    x = randn(2, 3, 5, 8)
    torch.testing.assert_close(rotate_half(x), upstream.rotate_half(x), atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_position_ids_follow_cuda_activations():
    rotary = ValidatedRotaryEmbedding(64, 128, base=4242.0).cuda()  # tables of its own
    x, pos = randn(2, 2, 9, 64).cuda(), positions("packed", 2, 9)
    cos, sin = rotary(x, pos)
    assert cos.device == x.device
    ref_cos, ref_sin = upstream.InternLM2RotaryEmbedding(64, 128, 4242.0).cuda()(x, pos.cuda())
    torch.testing.assert_close((cos, sin), (ref_cos, ref_sin), atol=1e-6, rtol=0)
    assert rotary.table_length(x.device) == 8  # largest position 4: 5 rows, a power of two
    q = randn(2, 4, 9, 64).cuda().requires_grad_()
    q_out, _ = apply_rotary_pos_emb(q, x, cos, sin)
    q_out.sum().backward()
    torch.testing.assert_close(q_out, upstream.apply_rotary_pos_emb(q, x, cos, sin)[0])


def test_layers_share_one_gather_of_cos_sin_per_forward(monkeypatch):
    """Every layer's rotary gets the same position_ids tensor: cos/sin rows are gathered once
    (and dynamic NTK's per-document frequencies built, with their host sync, once)."""
    import xtuner_rope.models.internlm2_rope as internlm2_rope

    layers = [ValidatedRotaryEmbedding(16, 32) for _ in range(3)]
    x, pos = randn(2, 2, 18, 16), positions("packed", 2, 18).clone()
    first = layers[0](x, pos)
    assert all(layer(x, pos)[0] is first[0] for layer in layers[1:])
    again = layers[1](x, pos.clone())  # the next forward's tensor: gathered anew
    assert again[0] is not first[0]
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    pos[:, -1] = 0  # changed in place: not the rows of before
    assert not torch.equal(layers[2](x, pos)[0], first[0])
    assert layers[0](x.bfloat16(), pos)[0].dtype == torch.bfloat16

    builds = []
    build = internlm2_rope.per_token_inv_freq
    monkeypatch.setattr(
        internlm2_rope, "per_token_inv_freq", lambda *a: builds.append(1) or build(*a)
    )
    ntk = [
        ValidatedRotaryEmbedding(16, 8, scaling_type="dynamic", scaling_factor=2.0) for _ in "abc"
    ]
    pos = positions("packed", 2, 18)  # a 10-token document: past the threshold of 8
    outs = [layer(x, pos) for layer in ntk]
    assert len(builds) == 1
    fresh = ntk[0](x, pos.clone())  # another forward: built again, the same values
    assert len(builds) == 2
    torch.testing.assert_close(fresh, outs[2], atol=0, rtol=0)
