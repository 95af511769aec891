"""Patched tiny models rotate through the Triton RoPE kernel (interpreted) as through eager.

Under `XTUNER_ROPE_TRITON_INTERPRET=1` the patched InternLM2 (its packed `wqkv` views) and
Llama / Qwen2 / Phi-3 / Cohere (interleaved pairs) layers rotate with the Triton kernel on CPU tensors; logits, loss and
every weight gradient of a packed batch (positions restarting per document, a different split
per row) must equal the eager kernel's within 1e-5 in fp32, and in bf16 within 6% of each
tensor's largest element (bf16 rounding through two layers; positions doubled move them by 25%
or more), dynamic NTK per document included.
Partial rotary is covered in tests/ops/test_rope_triton.py: transformers 4.48's Phi-3 rotates
the whole head.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from xtuner_rope.demo.tiny import build_tiny_hf, build_tiny_internlm2
from xtuner_rope.models.dispatch import patch_model
from xtuner_rope.ops.rope_triton import (
    INTERPRET_ENV,
    STRICT_ENV,
    interpreter_fault,
    triton_kernel_calls,
    use_triton_apply,
)

pytest.importorskip("triton")

VOCAB = 128
DOCS = [[5, 7], [3, 6, 3]]  # per row; 12 tokens each
NTK = dict(max_position_embeddings=4, rope_scaling=dict(type="dynamic", factor=2.0))
CASES = {
    "internlm2": ("internlm2", {}),
    "internlm2-dynamic-ntk": ("internlm2", NTK),
    "llama": ("llama", {}),
    "llama-dynamic-ntk": ("llama", dict(NTK, rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "qwen2": ("qwen2", {}),
    "phi3": ("phi3", {}),
    "cohere": ("cohere", {}),  # interleaved pairs
}


# q/k projections scaled up so that attention depends on the rotation (with the tiny models'
# small random weights it hardly does): in bf16, positions doubled move the gradients by 25% or
# more of their largest element, while the two kernels differ by 4% at most (bf16 rounding,
# carried through two layers of bf16 matmuls).
QK_WEIGHTS = re.compile(r"(wqkv|q_proj|k_proj|qkv_proj)\.weight$")
QK_SCALE = 4.0
BF16_SHARE = 0.06  # of each tensor's largest element


def assert_equal_within(got, want, dtype):
    """fp32: within 1e-5; bf16: each tensor within ``BF16_SHARE`` of its largest element."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    for g, w in zip(got, want):
        if isinstance(w, dict):
            assert g.keys() == w.keys()
            assert_equal_within(tuple(g.values()), tuple(w.values()), dtype)
            continue
        gap, scale = (g - w).abs().max().item(), w.abs().max().item()
        assert gap <= BF16_SHARE * scale, f"bf16 gap {gap:.3g} over {BF16_SHARE} x {scale:.3g}"


def run(model, ids, pos):
    """Logits, loss and weight gradients (fp32 copies) of one packed forward/backward."""
    model.zero_grad()
    logits = model(input_ids=ids, position_ids=pos).logits.float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_patched_model_with_the_kernel_equals_eager(case, dtype, monkeypatch):
    family, overrides = CASES[case]
    if family == "internlm2":
        model = build_tiny_internlm2(VOCAB, attn_implementation="eager", **overrides)
    else:
        model = build_tiny_hf(family, VOCAB, attn_implementation="sdpa", **overrides)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if QK_WEIGHTS.search(name):
                weight.mul_(QK_SCALE)
    model = model.to(dtype).train()
    patch_model(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (len(DOCS), 12), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])  # [b, s]
    monkeypatch.setenv(INTERPRET_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel sets it; unset after the test
    monkeypatch.setenv(STRICT_ENV, "1")  # a broken kernel fails, never falls back
    fault = interpreter_fault()  # where the package rotates CPU tensors eagerly
    if fault:
        pytest.skip(fault)
    use_triton_apply(False)
    eager = run(model, ids, pos)
    use_triton_apply(True)
    try:
        calls = triton_kernel_calls()
        kernel = run(model, ids, pos)
        assert triton_kernel_calls() == calls + 4  # 2 layers, forward and backward
    finally:
        use_triton_apply(None)
    assert kernel[2].keys() == eager[2].keys()
    assert_equal_within(kernel, eager, dtype)


@pytest.mark.parametrize("family", ["internlm2", "llama"])
def test_every_layer_rotates_with_the_same_fp32_tables(family, monkeypatch):
    """cos/sin are built once per forward, in the kernels' dtype: in a bf16 forward of the
    2-layer model, each layer's q and k rotate with the very same fp32 cos and sin tensors (a
    per-layer cast or gather would hand each layer its own)."""
    from xtuner_rope.ops import rope

    build = build_tiny_internlm2 if family == "internlm2" else build_tiny_hf
    model = build(*([] if family == "internlm2" else [family]), VOCAB, attn_implementation="eager")
    model = model.to(torch.bfloat16).train()
    patch_model(model)
    seen, rotate_heads = [], rope.rotate_heads

    def spy(x, cos, sin, *args):
        seen.append((cos, sin))
        return rotate_heads(x, cos, sin, *args)

    monkeypatch.setattr(rope, "rotate_heads", spy)
    use_triton_apply(False)
    try:
        ids = torch.randint(3, VOCAB, (len(DOCS), 12), generator=torch.Generator().manual_seed(0))
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])  # [b, s]
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos)
    finally:
        use_triton_apply(None)
    assert len(seen) == 2 * 2  # q and k of each layer
    assert {(c.dtype, s.dtype) for c, s in seen} == {(torch.float32, torch.float32)}
    assert len({id(c) for c, _ in seen}) == 1 and len({id(s) for _, s in seen}) == 1
