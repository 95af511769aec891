"""Tests for xtuner_rope/ops/rope_triton.py: the Triton RoPE kernel under Triton's interpreter.

`XTUNER_ROPE_TRITON_INTERPRET=1` (set by the fixture below) runs the kernel on CPU tensors;
each case compares it, forward and backward, with HF's `apply_rotary_pos_emb` that XTuner 0.2.0
ships for InternLM2 (in fp32 autograd, live; Cohere's, from transformers, for interleaved pairs)
and with the package's eager apply, and checks that
the kernel really ran (`triton_kernel_calls`). Small shapes: the interpreter is NumPy.
"""

import warnings

import pytest
import torch
from transformers.models.cohere.modeling_cohere import (
    apply_rotary_pos_emb as cohere_apply,
)
from xtuner._lite.modelings.internlm2.modeling_internlm2 import (
    apply_rotary_pos_emb as hf_apply,
)

from xtuner_rope.ops import rope_triton
from xtuner_rope.ops.rope import apply_rotary_pos_emb, cos_sin_at, inv_freq
from xtuner_rope.ops.rope_documents import per_token_inv_freq
from xtuner_rope.ops.rope_triton import (
    triton_apply_active,
    triton_kernel_calls,
    use_triton_apply,
)

pytest.importorskip("triton")

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),
    torch.float16: dict(atol=1e-5, rtol=1e-3),
}


# Tests that launch no interpreted kernel: they run where the interpreter cannot compute.
NO_INTERPRETED_KERNEL = ("cuda", "refused", "interpreter_probe")


@pytest.fixture(autouse=True)
def interpret(monkeypatch, request):
    if "cuda" not in request.node.name:  # the CUDA test runs the compiled kernel
        monkeypatch.setenv(rope_triton.INTERPRET_ENV, "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel sets it; unset after the test
    monkeypatch.setenv(rope_triton.STRICT_ENV, "1")  # a broken kernel fails, never falls back
    monkeypatch.delenv(rope_triton.SWITCH_ENV, raising=False)
    use_triton_apply(True)
    fault = rope_triton.interpreter_fault()  # where the package rotates CPU tensors eagerly
    if fault and not any(word in request.node.name for word in NO_INTERPRETED_KERNEL):
        pytest.skip(fault)
    yield
    use_triton_apply(None)


def packed_positions(b, s):
    """`[b, s]` positions restarting per document, a different split per row."""
    rows = []
    for row in range(b):
        docs, left = [], s
        while left:
            n = min(left, 3 + 2 * row + len(docs))
            docs.append(torch.arange(n))
            left -= n
        rows.append(torch.cat(docs))
    return torch.stack(rows)  # [b, s]


def make(b, s, n_h, n_kv, h_d, dtype, heads_first=True, device="cpu"):
    """q, k (leaf tensors, `[b, n, s, h_d]` or `[b, s, n, h_d]`) and output grads."""
    g = torch.Generator().manual_seed(0)

    def randn(shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    shapes = [(b, n, s, h_d) if heads_first else (b, s, n, h_d) for n in (n_h, n_kv)]
    q, k = (randn(shape).requires_grad_() for shape in shapes)
    return q, k, randn(shapes[0]), randn(shapes[1])


def reference(q, k, cos, sin, unsqueeze_dim, grads, interleaved=False):
    """HF's apply in fp32 (on the first rot dims; the rest passes): outputs and input grads;
    Cohere's for interleaved pairs."""
    rot = cos.shape[-1]
    apply = cohere_apply if interleaved else hf_apply
    q32, k32 = (x.detach().float().requires_grad_() for x in (q, k))
    q_r, k_r = apply(q32[..., :rot], k32[..., :rot], cos, sin, unsqueeze_dim=unsqueeze_dim)
    q_out = torch.cat((q_r, q32[..., rot:]), dim=-1)
    k_out = torch.cat((k_r, k32[..., rot:]), dim=-1)
    torch.autograd.backward((q_out, k_out), (grads[0].float(), grads[1].float()))
    return q_out.detach(), k_out.detach(), q32.grad, k32.grad


def check(q, k, cos, sin, grads, unsqueeze_dim=1, interleaved=False):
    """The kernel (fwd + bwd: two launches) against HF's fp32 apply and the eager apply."""
    calls = triton_kernel_calls()
    kwargs = dict(unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin, **kwargs)
    torch.autograd.backward((q_out, k_out), grads)
    assert triton_kernel_calls() == calls + 2, "the Triton kernel did not run"
    assert (q_out.dtype, k_out.dtype, q.grad.dtype) == (q.dtype, k.dtype, q.dtype)
    tol = TOL[q.dtype]
    ref = reference(q, k, cos, sin, unsqueeze_dim, grads, interleaved)
    for got, want in zip((q_out, k_out, q.grad, k.grad), ref):
        torch.testing.assert_close(got.float(), want, **tol)
    got = [t.detach().clone() for t in (q_out, k_out, q.grad, k.grad)]
    q.grad = k.grad = None
    use_triton_apply(False)
    q_e, k_e = apply_rotary_pos_emb(q, k, cos, sin, **kwargs)
    torch.autograd.backward((q_e, k_e), grads)
    assert triton_kernel_calls() == calls + 2  # the switch: eager
    for a, e in zip(got, (q_e, k_e, q.grad, k.grad)):
        torch.testing.assert_close(a.float(), e.float(), **tol)


# (b, s, n_h, n_kv, h_d, rot): odd lengths, GQA, MHA, head dims 16-256 (96: Phi-3's, a
# non-power-of-two half), partial rotary (the rest of h_d passes through).
SHAPES = [
    (2, 7, 4, 2, 16, 16),
    (1, 5, 3, 3, 96, 96),
    (2, 9, 4, 1, 32, 16),
    (1, 3, 2, 1, 256, 256),
    (1, 4, 2, 2, 64, 48),
]


@pytest.mark.parametrize("heads_first", [True, False], ids=["bnsd", "bsnd"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_hf_fp32_with_packed_positions(shape, heads_first):
    b, s, n_h, n_kv, h_d, rot = shape
    q, k, *grads = make(b, s, n_h, n_kv, h_d, torch.float32, heads_first)
    pos = packed_positions(b, s)
    cos, sin = cos_sin_at(pos, inv_freq(10000, rot), int(pos.max()))  # [b, s, rot] per row
    check(q, k, cos, sin, grads, unsqueeze_dim=1 if heads_first else 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_low_precision_rounds_once(dtype):
    q, k, *grads = make(2, 6, 4, 2, 32, dtype)
    cos, sin = cos_sin_at(packed_positions(2, 6), inv_freq(10000, 32), 5)
    check(q, k, cos, sin, grads)


def test_kernel_broadcasts_one_cos_row_and_bf16_tables():
    q, k, *grads = make(3, 5, 2, 2, 16, torch.float32)
    cos, sin = cos_sin_at(torch.arange(5)[None], inv_freq(10000, 16), 4)  # [1, s, h_d]
    check(q, k, cos, sin, grads)
    q.grad = k.grad = None
    use_triton_apply(True)
    check(q, k, cos.bfloat16(), sin.bfloat16(), grads)  # upcast to fp32 first, like eager


def test_kernel_per_token_frequencies_of_dynamic_ntk_documents():
    """Length-dependent RoPE: every token its document's inverse frequencies `[b, s, h_d/2]`."""
    q, k, *grads = make(2, 8, 2, 1, 16, torch.float32)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 0, 1, 2, 3, 4]])
    lengths = torch.tensor([[6] * 6 + [2] * 2, [3] * 3 + [5] * 5])
    base = inv_freq(10000, 16)
    freqs = per_token_inv_freq(lengths, base, 3, lambda n: inv_freq(10000 * n, 16))
    cos, sin = cos_sin_at(pos, freqs, 5)
    assert not torch.equal(cos[0, 5], cos_sin_at(pos, base, 5)[0][0, 5])  # NTK took effect
    check(q, k, cos, sin, grads)


def interleaved_cos_sin(pos, rot):
    """cos/sin `[b, s, rot]` as Cohere's rotary lays them out: `[f0, f0, f1, f1, ...]`."""
    cos, sin = cos_sin_at(pos, inv_freq(10000, rot, pos.device), int(pos.max()))
    return (t[..., : rot // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))


@pytest.mark.parametrize(
    "shape, dtype, heads_first",
    [
        ((2, 7, 4, 2, 16, 16), torch.float32, True),
        ((1, 5, 3, 3, 96, 96), torch.float32, False),
        ((2, 9, 4, 1, 32, 16), torch.float32, True),  # partial rotary
        ((2, 6, 4, 2, 32, 32), torch.bfloat16, True),
    ],
    ids=str,
)
def test_kernel_rotates_interleaved_pairs_as_cohere(shape, dtype, heads_first):
    """Cohere's layout: pairs (2i, 2i + 1), cos/sin `[f0, f0, f1, f1, ...]`, against Cohere's
    own apply in fp32; the eager apply (pairs gathered into halves) agrees."""
    b, s, n_h, n_kv, h_d, rot = shape
    q, k, *grads = make(b, s, n_h, n_kv, h_d, dtype, heads_first)
    cos, sin = interleaved_cos_sin(packed_positions(b, s), rot)
    check(q, k, cos, sin, grads, 1 if heads_first else 2, interleaved=True)
    q.grad = k.grad = None
    use_triton_apply(True)  # the rotate_half pairing is another rotation: the check must see it
    q_out, _ = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1 if heads_first else 2)
    want = reference(q, k, cos, sin, 1 if heads_first else 2, grads, interleaved=True)[0]
    assert (q_out.float() - want).abs().max() > 0.1


def test_kernel_reads_internlm2_packed_wqkv_views_in_place():
    """q, k as InternLM2's `_project_qkv` leaves them: strided views of one `wqkv` output."""
    b, s, n_kv, n_rep, h_d = 2, 5, 2, 2, 16
    qkv = torch.randn(b, s, n_kv, n_rep + 2, h_d, requires_grad=True)
    q = qkv[..., :n_rep, :].reshape(b, s, n_kv * n_rep, h_d).transpose(1, 2)  # [b, n_h, s, h_d]
    k = qkv[..., -2, :].transpose(1, 2)  # [b, n_kv, s, h_d], not contiguous
    cos, sin = cos_sin_at(packed_positions(b, s), inv_freq(10000, h_d), 4)
    grads = (torch.randn(q.shape), torch.randn(k.shape))
    calls = triton_kernel_calls()
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    torch.autograd.backward((q_out, k_out), grads)
    assert triton_kernel_calls() == calls + 2
    # Out in the [b, s, n, h_d] memory packed attention reads as [t, n, h_d]: no copy of k.
    assert q_out.transpose(1, 2).is_contiguous() and k_out.transpose(1, 2).is_contiguous()
    ref = reference(q, k, cos, sin, 1, grads)
    torch.testing.assert_close((q_out.detach(), k_out.detach()), ref[:2], **TOL[torch.float32])
    grad_qkv = torch.zeros_like(qkv)  # what the eager apply's grads scatter back into wqkv
    grad_qkv[..., :n_rep, :] = ref[2].transpose(1, 2).reshape(b, s, n_kv, n_rep, h_d)
    grad_qkv[..., -2, :] = ref[3].transpose(1, 2)
    torch.testing.assert_close(qkv.grad, grad_qkv, **TOL[torch.float32])


# (b, s, n_h, n_kv, h_d, rot), dtype, heads first: few cases, each compiles two kernels.
CUDA_CASES = [
    ((2, 33, 16, 8, 128, 128), torch.bfloat16, True, False),
    ((2, 33, 16, 8, 128, 128), torch.float32, True, False),
    ((1, 40, 4, 2, 96, 64), torch.float16, False, False),
    ((2, 33, 8, 8, 128, 128), torch.bfloat16, True, True),  # Cohere's interleaved pairs
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape, dtype, heads_first, interleaved", CUDA_CASES, ids=str)
def test_compiled_kernel_on_cuda_matches_hf_fp32(shape, dtype, heads_first, interleaved):
    """The kit's correctness step: the compiled kernel, the CUDA default, not the interpreter."""
    b, s, n_h, n_kv, h_d, rot = shape
    q, k, *grads = make(b, s, n_h, n_kv, h_d, dtype, heads_first, "cuda")
    pos = packed_positions(b, s).cuda()
    if interleaved:
        cos, sin = interleaved_cos_sin(pos, rot)
    else:
        cos, sin = cos_sin_at(pos, inv_freq(10000, rot, "cuda"), int(pos.max()))
    use_triton_apply(None)
    check(q, k, cos, sin, grads, 1 if heads_first else 2, interleaved)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_on_cuda_past_int32_offsets():
    """600k tokens x 32 heads of 128 dims, heads first: the last head starts 2.4e9 elements in
    (past int32's 2**31, where `h * x_sn` overflowed); it and the first head rotate right."""
    s = 600_000
    q = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, s, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = cos_sin_at(torch.arange(s, device="cuda")[None], inv_freq(10000, 128, "cuda"), s - 1)
    use_triton_apply(None)
    calls = triton_kernel_calls()
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    assert triton_kernel_calls() == calls + 1
    for head in (0, 31):
        want, _ = hf_apply(q[:, head : head + 1].float(), k[:, :1].float(), cos, sin)
        torch.testing.assert_close(q_out[:, head : head + 1].float(), want, **TOL[torch.bfloat16])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_compiled_kernel_on_a_cuda_device_that_is_not_current():
    """q, k on cuda:1 while cuda:0 is current: the launch goes to their device."""
    q, k, *grads = make(2, 33, 16, 8, 128, torch.bfloat16, True, "cuda:1")
    pos = packed_positions(2, 33).to("cuda:1")
    cos, sin = cos_sin_at(pos, inv_freq(10000, 128, "cuda:1"), int(pos.max()))
    use_triton_apply(None)
    with torch.cuda.device(0):
        check(q, k, cos, sin, grads)


def test_switches_choose_the_kernel(monkeypatch):
    x = torch.zeros(1)
    assert triton_apply_active(x)
    use_triton_apply(False)
    assert not triton_apply_active(x)
    use_triton_apply(True)
    monkeypatch.delenv(rope_triton.INTERPRET_ENV)
    assert not triton_apply_active(x)  # the CPU default: eager
    monkeypatch.setenv(rope_triton.INTERPRET_ENV, "1")
    use_triton_apply(None)  # as at start-up: the environment decides
    assert triton_apply_active(x)
    monkeypatch.setenv(rope_triton.SWITCH_ENV, "0")
    assert not triton_apply_active(x)


def test_rotary_dim_beyond_head_dim_is_refused():
    q, k = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8)
    cos = torch.zeros(1, 3, 10)
    with pytest.raises(ValueError, match=r"one even head dim h_d, got q .*an even rotary dim"):
        apply_rotary_pos_emb(q, k, cos, cos)


def test_the_interpreter_probe_decides_cpu_tensors(monkeypatch):
    """A probe fault (Triton 3.0.0 with NumPy 2) warns once, naming both, and CPU tensors then
    rotate eagerly and correctly; without one (Triton 3.9.0) the kernel runs."""
    import numpy
    import triton

    monkeypatch.setitem(rope_triton._state, "fault", None)  # probe again in this test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fault = rope_triton.interpreter_fault()
        assert rope_triton.interpreter_fault() == fault  # probed once
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    q, k, *grads = make(1, 6, 2, 1, 8, torch.float32)
    pos = packed_positions(1, 6)
    cos, sin = cos_sin_at(pos, inv_freq(10000, 8), int(pos.max()))
    calls = triton_kernel_calls()
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    ref = reference(q, k, cos, sin, 1, grads)
    torch.testing.assert_close((q_out.detach(), k_out.detach()), ref[:2], **TOL[torch.float32])
    if fault is None:
        assert warned == [] and triton_apply_active(q)
        assert triton_kernel_calls() == calls + 1
    else:
        assert len(warned) == 1 and fault in warned[0]
        assert f"Triton {triton.__version__}" in fault and f"NumPy {numpy.__version__}" in fault
        assert not triton_apply_active(q) and triton_kernel_calls() == calls
