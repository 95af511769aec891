"""The validated RoPE of the transformers families against transformers' live
``ROPE_INIT_FUNCTIONS``, float64 math, and the upstream rotary after ``.bfloat16()``."""

import math

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from xtuner_rope.models import HFValidatedRotaryEmbedding
from xtuner_rope.models.hf_rope import patch_hf_fp32_rotation

LLAMA31 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
CONFIGS = {  # head_dim 128, as the real models
    "default": LlamaConfig(
        hidden_size=1024, num_attention_heads=8, rope_theta=500000.0, max_position_embeddings=8192
    ),
    "linear": LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        max_position_embeddings=8192,
        rope_scaling=dict(type="linear", factor=4.0),
    ),
    "dynamic": LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        max_position_embeddings=8192,
        rope_scaling=dict(rope_type="dynamic", factor=2.0),
    ),
    "llama3": LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=LLAMA31,
    ),
    "yarn": Qwen2Config(
        hidden_size=1024,
        num_attention_heads=8,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
    ),
}
POSITION = 32768


def float64_inv_freq(rope_type, config, seq_len):
    """Inverse frequencies and attention scaling in float64, from the papers' formulas."""
    dim, base = 128, config.rope_theta
    scaling = config.rope_scaling or {}
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    if rope_type == "dynamic" and seq_len > config.max_position_embeddings:
        ratio = scaling["factor"] * seq_len / config.max_position_embeddings - scaling["factor"] + 1
        base = base * ratio ** (dim / (dim - 2))
    inv = base**-exponents
    if rope_type == "linear":
        return inv / scaling["factor"], 1.0
    if rope_type == "llama3":
        wavelength, ctx = 2 * math.pi / inv, scaling["original_max_position_embeddings"]
        smooth = ((ctx / wavelength - 1.0) / 3.0).clamp(0, 1)  # low 1, high 4
        return (1 - smooth) * inv / scaling["factor"] + smooth * inv, 1.0
    if rope_type == "yarn":
        turns_dim = [
            dim
            * math.log(config.max_position_embeddings / (t * 2 * math.pi))
            / (2 * math.log(base))
            for t in (32, 1)
        ]
        low, high = max(math.floor(turns_dim[0]), 0), min(math.ceil(turns_dim[1]), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        factor = scaling["factor"]
        return inv / factor * ramp + inv * (1 - ramp), 0.1 * math.log(factor) + 1
    return inv, 1.0


@pytest.mark.parametrize("rope_type", list(CONFIGS))
def test_inv_freq_matches_transformers(rope_type):
    config = CONFIGS[rope_type]
    ours = HFValidatedRotaryEmbedding(config)
    theirs, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    torch.testing.assert_close(ours.inv_freq, theirs, rtol=0, atol=0)  # bit-exact
    assert ours.attention_scaling == scaling and ours.rope_type == rope_type
    if rope_type == "dynamic":
        for seq_len in (8192, 8193, 20000, 3 * 8192 + 5):
            theirs, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
            torch.testing.assert_close(ours.inv_freq_at(seq_len), theirs, rtol=0, atol=0)


@pytest.mark.parametrize("rope_type", list(CONFIGS))
def test_cos_sin_after_bfloat16_match_float64(rope_type):
    config = CONFIGS[rope_type]
    ours = HFValidatedRotaryEmbedding(config, max_position=2 * POSITION).bfloat16()
    positions = torch.arange(POSITION - 3, POSITION + 1)[None]  # [1, 4]
    x = torch.zeros(1, 4, 8, dtype=torch.bfloat16)
    cos, sin = ours(x, positions)
    inv, scale = float64_inv_freq(rope_type, config, POSITION + 1)
    angles = positions[0, :, None].double() * inv
    angles = torch.cat((angles, angles), dim=-1)  # [4, h_d]
    assert ours.inv_freq.dtype == torch.float32 and cos.dtype == torch.float32
    # Angles are fp32 products as upstream's (what the model was trained with): the fp32
    # rounding of inv_freq (half an ulp, ~3e-8 relative) moves an angle at 32768 by up to
    # ~1.3e-3 rad; nothing else adds error.
    assert (cos[0].double() - angles.cos() * scale).abs().max() < 2e-3
    assert (sin[0].double() - angles.sin() * scale).abs().max() < 2e-3
    # ... and they equal the uncast upstream module's fp32 cos/sin exactly.
    up_cos, up_sin = LlamaRotaryEmbedding(config)(x.float(), positions)
    torch.testing.assert_close((cos, sin), (up_cos, up_sin), rtol=0, atol=0)
    if rope_type != "dynamic":  # upstream recomputes dynamic frequencies in fp32 when it grows
        up_cos, _ = LlamaRotaryEmbedding(config).bfloat16()(x, positions)
        assert (up_cos[0].double() - angles.cos() * scale).abs().max() > 0.1


def test_dynamic_ntk_beyond_fp32_exact_positions_matches_float64():
    """Dynamic NTK has no position limit: from 2**24 on (fp32 cannot hold every position),
    the angles are computed in float64 and cos/sin match a float64 computation."""
    ours = HFValidatedRotaryEmbedding(CONFIGS["dynamic"])
    positions = torch.tensor([[2**24 - 1, 2**24 + 1, 2**24 + 3, 2**25 + 7, 5]])  # [1, 5]
    cos, sin = ours(torch.zeros(1, 5, 8), positions)
    inv_freq = ours.inv_freq_at(int(positions.max()) + 1).double()
    angles = positions[0, :, None].double() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)  # [5, h_d]
    torch.testing.assert_close(
        (cos[0].double(), sin[0].double()), (angles.cos(), angles.sin()), rtol=0, atol=1e-6
    )
    # fp32 angles (upstream's arithmetic) would be off by far more.
    fp32 = positions[0, :, None].float() * inv_freq.float()
    assert (torch.cat((fp32, fp32), dim=-1).cos().double() - angles.cos()).abs().max() > 0.5


def test_dynamic_ntk_is_stateless():
    config = CONFIGS["dynamic"]
    ours, fresh = HFValidatedRotaryEmbedding(config), HFValidatedRotaryEmbedding(config)
    x = torch.zeros(1, 1, 8)
    ours(x, torch.tensor([[30000]]))  # a long batch first
    for pos in (12000, 100):
        torch.testing.assert_close(
            ours(x, torch.tensor([[pos]])), fresh(x, torch.tensor([[pos]])), rtol=0, atol=0
        )


def test_limits_and_errors():
    assert HFValidatedRotaryEmbedding(CONFIGS["linear"]).limit()[0] == 32768
    assert HFValidatedRotaryEmbedding(CONFIGS["llama3"]).limit()[0] == 131072
    assert HFValidatedRotaryEmbedding(CONFIGS["yarn"]).limit()[0] == 131072
    assert HFValidatedRotaryEmbedding(CONFIGS["dynamic"]).limit()[0] is None
    ours = HFValidatedRotaryEmbedding(CONFIGS["linear"])
    with pytest.raises(ValueError, match=r"holds 32768 .* linear scaling factor 4.0 x 8192"):
        ours(torch.zeros(1, 1, 8), torch.tensor([[32768]]))
    with pytest.raises(TypeError, match="position_ids must be an integer tensor"):
        ours(torch.zeros(1, 1, 8), torch.tensor([[1.0]]))
    longrope = LlamaConfig(
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 64, long_factor=[1.0] * 64)
    )
    with pytest.raises(ValueError, match="rope_type='longrope' of LlamaConfig is not supported"):
        HFValidatedRotaryEmbedding(longrope)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_family_apply_rotates_low_precision_q_k_in_fp32(dtype):
    patch_hf_fp32_rotation("transformers.models.llama.modeling_llama")
    rotary = HFValidatedRotaryEmbedding(CONFIGS["yarn"])  # attention scaling 1.14
    positions = torch.randint(0, 131072, (2, 16))
    cos, sin = rotary(torch.zeros(2, 16, 8), positions)  # fp32 [2, 16, 128]
    # Pairs near fp16's largest value (65504): their rotation stays in range, their
    # intermediate sums in fp16 need not.
    q = (torch.rand(2, 4, 16, 128) * 2 - 1) * 40000
    k = torch.randn(2, 2, 16, 128)
    rq, rk = modeling_llama.apply_rotary_pos_emb(q.to(dtype), k.to(dtype), cos, sin)
    assert rq.dtype == dtype and torch.isfinite(rq).all()
    half = 64
    q64, c64, s64 = q.to(dtype).double(), cos.double()[:, None], sin.double()[:, None]
    rotated = torch.cat((-q64[..., half:], q64[..., :half]), dim=-1)
    truth = q64 * c64 + rotated * s64
    # One rounding of the result (half an ulp), plus fp32 rounding of the 4e4-sized terms.
    tol = 2**-11 if dtype == torch.float16 else 2**-8
    assert ((rq.double() - truth).abs() <= tol * truth.abs() + 40000 * 2**-22).all()


def test_family_apply_unchanged_for_unpatched_calls():
    patch_hf_fp32_rotation("transformers.models.llama.modeling_llama")
    original = modeling_llama.apply_rotary_pos_emb.__wrapped__
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    cos, sin = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    for dtype in (torch.float32, torch.bfloat16):
        args = (q.to(dtype), k.to(dtype), cos.to(dtype), sin.to(dtype))
        for ours, theirs in zip(modeling_llama.apply_rotary_pos_emb(*args), original(*args)):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
