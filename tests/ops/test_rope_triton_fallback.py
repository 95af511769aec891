"""Tests for xtuner_rope/ops/rope_triton.py: a kernel that fails never stops a run.

Under `XTUNER_ROPE_TRITON_INTERPRET=1` alone (no `XTUNER_ROPE_TRITON_STRICT`), the interpreted
kernel behaves as the compiled one does on CUDA. Each failure is injected where it happens for
real: Triton failing to import, and Triton's launcher (`run`, which compiles a variant on its
first call) raising for the forward or the backward (`TRANSPOSE`) variant. The run goes on with
the eager kernel's outputs and gradients and exactly one warning; an out-of-memory error is
raised as one; under the strict switch every failure raises.
"""

import sys
import types
import warnings

import pytest
import torch
from triton.runtime.errors import OutOfResources

from xtuner_rope.ops import rope_triton
from xtuner_rope.ops.rope import apply_rotary_pos_emb, cos_sin_at, inv_freq
from xtuner_rope.ops.rope_triton import (
    triton_apply_active,
    triton_kernel_calls,
    use_triton_apply,
)


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(rope_triton.INTERPRET_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel sets it; unset after the test
    for name in (rope_triton.STRICT_ENV, rope_triton.SWITCH_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(rope_triton._state, "compiled", set())  # every variant compiles anew
    monkeypatch.setitem(rope_triton._state, "warned", False)
    use_triton_apply(True)
    if rope_triton.interpreter_fault():
        pytest.skip(rope_triton.interpreter_fault())
    yield
    use_triton_apply(None)


def inputs(heads_first=True):
    """q, k (InternLM2's shapes, tiny; partial rotary), packed cos/sin and output grads."""
    g = torch.Generator().manual_seed(0)
    b, s, n_h, n_kv, h_d, rot = 2, 7, 4, 2, 16, 12
    shape = (lambda n: (b, n, s, h_d)) if heads_first else (lambda n: (b, s, n, h_d))
    q, k = (torch.randn(shape(n), generator=g).requires_grad_() for n in (n_h, n_kv))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    cos, sin = cos_sin_at(pos, inv_freq(10000, rot), 4)  # [b, s, rot]
    grads = (torch.randn(shape(n_h), generator=g), torch.randn(shape(n_kv), generator=g))
    return q, k, cos, sin, grads


def step(q, k, cos, sin, grads, unsqueeze_dim=1, between=None):
    """Forward and backward: outputs, input grads, and the package's warnings of each half."""
    q.grad = k.grad = None
    with warnings.catch_warnings(record=True) as forward:
        warnings.simplefilter("always")
        q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    if between is not None:
        between()
    with warnings.catch_warnings(record=True) as backward:
        warnings.simplefilter("always")
        torch.autograd.backward((q_out, k_out), grads)
    said = [
        [str(w.message) for w in ws if "xtuner_rope" in str(w.message)]
        for ws in (forward, backward)
    ]
    return [t.detach().clone() for t in (q_out, k_out, q.grad, k.grad)], said


def eager(q, k, cos, sin, grads, unsqueeze_dim=1):
    use_triton_apply(False)
    try:
        return step(q, k, cos, sin, grads, unsqueeze_dim)[0]
    finally:
        use_triton_apply(True)


def fail_launches(monkeypatch, transpose, error):
    """Triton's launcher raises `error` for the variant `TRANSPOSE=transpose` (a compile or
    launch failure there); the other variant runs."""
    kernel = rope_triton._kernel()
    original = kernel.run

    def run(*args, **kwargs):
        if kwargs["TRANSPOSE"] == transpose:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", run)


def assert_runs_on_eagerly(steps, want, where="", error="OutOfResources"):
    """Steps `(results, said)`: one warning in all (naming the error), the eager results."""
    warned = [line for _, said in steps for half in said for line in half]
    assert len(warned) == 1, warned
    assert where in warned[0] and error in warned[0], warned[0]
    for results, _ in steps:
        for got, expected in zip(results, want):
            torch.testing.assert_close(got, expected)


def test_forward_compile_failure_warns_once_and_rotates_eagerly(monkeypatch):
    q, k, cos, sin, grads = inputs()
    want = eager(q, k, cos, sin, grads)
    fail_launches(monkeypatch, False, OutOfResources(1 << 20, 1 << 16, "shared memory"))
    calls = triton_kernel_calls()
    first, second = step(q, k, cos, sin, grads), step(q, k, cos, sin, grads)
    assert first[1][0] and not first[1][1]  # said in the forward
    assert_runs_on_eagerly((first, second), want, "the forward")
    assert triton_kernel_calls() == calls and not triton_apply_active(q)


def test_backward_variant_fails_at_the_first_forward_not_in_backward(monkeypatch):
    """Both variants compile at the first forward: a backward that cannot compile shows
    there, and that call's forward and backward are the eager kernel's."""
    q, k, cos, sin, grads = inputs(heads_first=False)
    want = eager(q, k, cos, sin, grads, 2)
    fail_launches(monkeypatch, True, OutOfResources(1 << 20, 1 << 16, "shared memory"))
    calls = triton_kernel_calls()
    first, second = step(q, k, cos, sin, grads, 2), step(q, k, cos, sin, grads, 2)
    assert first[1][0] and not first[1][1]  # said in the forward, before any backward
    assert_runs_on_eagerly((first, second), want, "backward")
    assert triton_kernel_calls() == calls


def test_backward_launch_failure_falls_back_within_that_backward(monkeypatch):
    """A backward launch that fails after its forward ran the kernel: the eager transpose
    gives that very call the same gradients."""
    q, k, cos, sin, grads = inputs()
    want = eager(q, k, cos, sin, grads)
    error = OutOfResources(1 << 20, 1 << 16, "shared memory")
    calls = triton_kernel_calls()
    first = step(q, k, cos, sin, grads, between=lambda: fail_launches(monkeypatch, True, error))
    assert triton_kernel_calls() == calls + 1  # the forward ran the kernel
    second = step(q, k, cos, sin, grads)
    assert first[1][1] and not first[1][0]  # said in the backward
    assert_runs_on_eagerly((first, second), want, "the backward")
    assert triton_kernel_calls() == calls + 1 and not triton_apply_active(q)


def test_triton_that_fails_to_import_warns_once_naming_what_to_install(monkeypatch):
    """Any import error (here a RuntimeError, as a Triton built for another CUDA raises):
    one warning naming the Triton this torch wants, and the eager kernel."""
    q, k, cos, sin, grads = inputs()
    want = eager(q, k, cos, sin, grads)
    broken = types.ModuleType("xtuner_rope.ops.rope_triton_kernel")

    def missing(name):
        raise RuntimeError("injected: libcuda.so.1: cannot open shared object file")

    broken.__getattr__ = missing
    monkeypatch.setitem(sys.modules, "xtuner_rope.ops.rope_triton_kernel", broken)
    monkeypatch.setitem(rope_triton._state, "kernel", None)  # import it again
    first, second = step(q, k, cos, sin, grads), step(q, k, cos, sin, grads)
    assert_runs_on_eagerly((first, second), want, "pip install 'triton", "RuntimeError: injected")
    assert "Triton does not import here" in first[1][0][0]


def test_out_of_memory_is_raised_and_keeps_the_kernel_on(monkeypatch):
    q, k, cos, sin, grads = inputs()
    fail_launches(monkeypatch, False, torch.cuda.OutOfMemoryError("injected: CUDA out of memory"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        with pytest.raises(torch.cuda.OutOfMemoryError, match="injected"):
            apply_rotary_pos_emb(q, k, cos, sin)
    assert triton_apply_active(q)


def test_strict_switch_raises_every_failure(monkeypatch):
    monkeypatch.setenv(rope_triton.STRICT_ENV, "1")
    q, k, cos, sin, grads = inputs()
    fail_launches(monkeypatch, False, OutOfResources(1 << 20, 1 << 16, "shared memory"))
    with pytest.raises(OutOfResources):
        apply_rotary_pos_emb(q, k, cos, sin)
    assert triton_apply_active(q)
