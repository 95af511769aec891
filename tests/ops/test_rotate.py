"""Tests for xtuner_rope/ops/rotate.py: the fused kernel against the eager one and upstream."""

import pytest
import torch
from torch._dynamo.utils import counters
from xtuner._lite.modelings.internlm2 import modeling_internlm2 as upstream

from xtuner_rope.models.internlm2_rope import ValidatedRotaryEmbedding
from xtuner_rope.ops import rotate
from xtuner_rope.ops.rope import apply_rotary_pos_emb, use_fused_apply
from xtuner_rope.ops.rotate import fused_kernel_calls

TOL = {
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),
    torch.float16: dict(atol=1e-5, rtol=1e-3),
}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transpose", [False, True])
def test_fused_matches_eager(fused, dtype, transpose):
    # Odd sizes, cos/sin whose halves differ (so the transpose is not the inverse rotation).
    x = randn(2, 3, 7, 16, dtype=dtype)
    cos, sin = randn(2, 1, 7, 16, seed=1), randn(2, 1, 7, 16, seed=2)
    calls = fused_kernel_calls()
    out = rotate.rotate(x, cos, sin, transpose)
    assert fused_kernel_calls() == calls + 1  # the compiled kernel ran, not the eager fall-back
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rotate.rotate_eager(x, cos, sin, transpose), **TOL[dtype])


def test_fused_apply_matches_upstream_forward_and_backward(fused):
    # [b, s, n, h_d] activations seen as [b, n, s, h_d] views, as InternLM2 passes them.
    q = randn(2, 9, 4, 32).transpose(1, 2).requires_grad_()
    k = randn(2, 9, 2, 32, seed=3).transpose(1, 2).requires_grad_()
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], list(range(9))])
    cos, sin = ValidatedRotaryEmbedding(32, 64)(q, positions)
    grads = randn(2, 4, 9, 32, seed=4), randn(2, 2, 9, 32, seed=5)
    results, calls = [], fused_kernel_calls()
    for apply in (apply_rotary_pos_emb, upstream.apply_rotary_pos_emb):
        qi, ki = (t.detach().requires_grad_() for t in (q, k))
        outs = apply(qi, ki, cos, sin)
        torch.autograd.backward(outs, grads)
        results.append((*outs, qi.grad, ki.grad))
    assert fused_kernel_calls() == calls + 4  # q and k, forward and backward: all compiled
    for mine, theirs in zip(*results):
        torch.testing.assert_close(mine, theirs, **TOL[torch.float32])


def test_new_lengths_reuse_the_kernel(fused):
    # Sizes 1 are specialised by torch.compile, so warm up with b, n > 1 at two lengths; after
    # that new batch sizes, head counts and lengths must not compile again.
    for s in (5, 11):
        rotate.rotate(randn(2, 3, s, 16), randn(2, 1, s, 16), randn(2, 1, s, 16), False)
    graphs, calls = counters["stats"]["unique_graphs"], fused_kernel_calls()
    for b, n, s in ((3, 4, 37), (2, 6, 300)):
        x, cos, sin = randn(b, n, s, 16), randn(b, 1, s, 16, seed=1), randn(b, 1, s, 16, seed=2)
        torch.testing.assert_close(
            rotate.rotate(x, cos, sin, False),
            rotate.rotate_eager(x, cos, sin, False),
            **TOL[torch.float32],
        )
    assert counters["stats"]["unique_graphs"] == graphs and fused_kernel_calls() == calls + 2


def test_compile_failure_falls_back_to_eager(monkeypatch):
    # What a machine without a C++ compiler (CPU) or Triton (CUDA) gets from torch.compile.
    def broken(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setitem(rotate._fused, "fn", broken)
    monkeypatch.setitem(rotate._fused, "enabled", True)
    calls = fused_kernel_calls()
    x, cos, sin = randn(1, 2, 5, 8), randn(1, 1, 5, 8, seed=1), randn(1, 1, 5, 8, seed=2)
    with pytest.warns(
        RuntimeWarning,
        match=r"fused RoPE kernel failed .* on cpu \(RuntimeError: "
        r"InvalidCxxCompiler.*\); using the eager kernel",
    ):
        out = rotate.rotate(x, cos, sin, False)
    torch.testing.assert_close(out, rotate.rotate_eager(x, cos, sin, False), rtol=0, atol=0)
    assert fused_kernel_calls() == calls  # the fall-back is not counted as a fused call
    assert use_fused_apply(False) is False  # switched itself off: no warning per call


def test_use_fused_apply_returns_previous_state():
    assert use_fused_apply(True) is False
    assert use_fused_apply(False) is True


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no silent fall-back to eager
def test_fused_kernel_inside_a_compiled_function(fused):
    # A user who compiles the whole model: the kernel is traced into that graph, not nested.
    x, cos, sin = randn(2, 3, 6, 16), randn(2, 1, 6, 16, seed=1), randn(2, 1, 6, 16, seed=2)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled = torch.compile(lambda t: rotate.rotate(t, cos, sin, False) * 2.0)
    torch.testing.assert_close(
        compiled(x), rotate.rotate_eager(x, cos, sin, False) * 2.0, **TOL[torch.float32]
    )
    # One graph holding the rotation and the product, no break around the kernel.
    assert counters["stats"]["unique_graphs"] == graphs + 1
    assert sum(counters["graph_break"].values()) == breaks
