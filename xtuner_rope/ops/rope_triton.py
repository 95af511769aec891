"""The Triton RoPE apply: q and k rotated in one launch, forward and backward (CUDA default).

``rope.apply_rotary_pos_emb`` sends q, k here when :func:`triton_apply_active`;
``XTUNER_ROPE_TRITON_INTERPRET=1`` interprets it on CPU tensors (tests). A kernel that cannot
run never stops training: one warning and the eager kernel takes over for the process (CUDA
out-of-memory re-raised; ``XTUNER_ROPE_TRITON_STRICT=1`` re-raises all).
"""

import contextlib
import os
import warnings
from importlib import metadata

import torch
from torch.autograd.function import once_differentiable

from xtuner_rope.ops.rotate import rotate_heads

__all__ = [
    "INTERPRET_ENV",
    "STRICT_ENV",
    "SWITCH_ENV",
    "interpreter_fault",
    "triton_apply",
    "triton_apply_active",
    "triton_kernel_calls",
    "use_triton_apply",
]

SWITCH_ENV = "XTUNER_ROPE_TRITON"  # "0": the eager kernel everywhere
INTERPRET_ENV = "XTUNER_ROPE_TRITON_INTERPRET"  # "1": the kernel on CPU tensors, interpreted
STRICT_ENV = "XTUNER_ROPE_TRITON_STRICT"  # "1": a failing kernel raises (tests) instead of eager
# enabled: None until use_triton_apply is called (then SWITCH_ENV decides); kernel: None until
# the first use, then the jitted kernel or False (Triton does not import: `missing` says why,
# and `warned` once it was said); calls: launches served; fault: None until the interpreter
# is probed, then "" (it computes) or why not; compiled: the shapes whose backward variant was
# compiled at their first forward.
_state = {
    "enabled": None,
    "kernel": None,
    "missing": None,
    "warned": False,
    "calls": 0,
    "fault": None,
    "compiled": set(),
}
_TILE = 1024  # q elements (half a rotary dim per head) per program, see _launch


def _interpret():
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def _strict():
    return os.environ.get(STRICT_ENV, "0") == "1"


def use_triton_apply(enabled=True):
    """Turn the Triton rotary kernel on (True) or off (False: eager everywhere) for this process;
    None (the default): `XTUNER_ROPE_TRITON` decides. Returns whether it was on before."""
    before = _enabled()
    _state["enabled"] = None if enabled is None else bool(enabled)
    return before


def _enabled():
    if _state["enabled"] is None:
        return os.environ.get(SWITCH_ENV, "1") != "0"
    return _state["enabled"]


def triton_kernel_calls():
    """Launches of the Triton rotary kernel in this process (forward and backward each count):
    tests and benchmarks tell a kernel run from a silent eager fall-back by it."""
    return _state["calls"]


def _kernel():
    """The jitted kernel, or None where Triton does not import (`_state["missing"]`: why)."""
    if _state["kernel"] is None:
        if _interpret():  # triton.jit reads it when the kernel module below is imported
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            from xtuner_rope.ops.rope_triton_kernel import rope_kernel
        # Not only ImportError: a Triton built for another torch or CUDA can raise anything.
        except Exception as error:  # noqa: BLE001 - reported at the first rotation it serves
            _state["kernel"] = False
            _state["missing"] = f"{type(error).__name__}: {str(error)[:300]}"
        else:
            _state["kernel"] = rope_kernel
    return _state["kernel"] or None


def _wanted_triton():
    """The Triton requirement of this torch build (its metadata), e.g. `triton==3.6.0`."""
    try:
        requires = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        requires = []
    wanted = [r.split(";")[0].strip() for r in requires if r.lower().startswith("triton")]
    return wanted[0].replace(" ", "") if wanted else "triton"


def _warn_missing(x):
    """Once per process: the kernel is wanted for x's device but Triton did not import."""
    if _state["warned"]:
        return
    _state["warned"] = True
    message = (
        f"xtuner_rope: Triton does not import here ({_state['missing']}), so RoPE on "
        f"{x.device.type} runs the eager kernel (slower: three passes over q and k instead of "
        f"one). Install the Triton this torch {torch.__version__} was built with: "
        f"pip install '{_wanted_triton()}' (or set {SWITCH_ENV}=0 to silence this)."
    )
    if _strict():
        raise RuntimeError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def triton_apply_active(x):
    """Whether `rope.apply_rotary_pos_emb` rotates q/k like `x` with Triton: on CUDA (or on the CPU
    under `XTUNER_ROPE_TRITON_INTERPRET=1` without an :func:`interpreter_fault`) when the kernel is
    on, Triton imports and no trace is running."""
    if torch.compiler.is_compiling() or not _enabled():
        return False
    if x.device.type != "cuda" and not (x.device.type == "cpu" and _interpret()):
        return False
    if _kernel() is None:
        _warn_missing(x)
        return False
    return x.device.type == "cuda" or interpreter_fault() is None


def interpreter_fault():
    """Why Triton's interpreter cannot run the kernel here; None where it can.

    Probed once, under `XTUNER_ROPE_TRITON_INTERPRET=1` only: a copy kernel of 4 floats (Triton
    3.0.0 with NumPy 2 reads wrong values). The first fault warns once; CPU tensors then rotate
    eagerly, and tests skip with this reason. The answer names the Triton and NumPy versions,
    what the copy read, and the fix.
    """
    if not _interpret() or _kernel() is None:
        return None
    if _state["fault"] is None:
        _state["fault"] = _probe_interpreter()
        if _state["fault"]:
            warnings.warn(f"xtuner_rope: {_state['fault']}", RuntimeWarning, stacklevel=3)
    return _state["fault"] or None


def _probe_interpreter():
    """ "" if the interpreted copy kernel copies, else the fault in words."""
    import numpy
    import triton

    from xtuner_rope.ops.rope_triton_kernel import copy_kernel

    x, out = torch.arange(1.0, 5.0), torch.zeros(4)
    try:
        copy_kernel[(1,)](x, out, 4, BLOCK=4)
        got = out.tolist()
    except Exception as error:  # noqa: BLE001 - reported: the interpreter cannot run here
        got = f"{type(error).__name__}: {str(error)[:200]}"
    if got == x.tolist():
        return ""
    return (
        f"Triton {triton.__version__}'s interpreter ({INTERPRET_ENV}=1) does not compute with "
        f"NumPy {numpy.__version__}: a copy of {x.tolist()} read {got}; the CPU tensors rotate "
        "with the eager kernel instead. Triton 3.0's interpreter needs NumPy < 2 (1.26.4 "
        "computes); Triton 3.9.0 (torch 2.15) computes with NumPy 2."
    )


def _bshd(x, unsqueeze_dim):
    """`[b, s, n, h_d]` view of q/k/grad laid out as `[b, n, s, h_d]` (unsqueeze_dim 1)."""
    return x.transpose(1, 2) if unsqueeze_dim == 1 else x  # [b, s, n, h_d]


def _empty_bshd(x, unsqueeze_dim):
    """An empty tensor shaped like x whose memory is `[b, s, n, h_d]`: packed attention reads
    it as `[t, n, h_d]` without a copy (InternLM2's k, a strided view of `wqkv`, would give
    `torch.empty_like` a `[b, n, s, h_d]` layout: a hidden copy of k for batch > 1)."""
    b, s, n, h_d = _bshd(x, unsqueeze_dim).shape
    out = torch.empty(b, s, n, h_d, dtype=x.dtype, device=x.device)  # [b, s, n, h_d]
    return _bshd(out, unsqueeze_dim)  # x's shape


def _pow2(n):
    return 1 << max(n - 1, 0).bit_length()


def _on_device(x):
    """x's CUDA device made current: Triton launches on the current device's stream."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _launch(q, k, cos, sin, unsqueeze_dim, transpose, interleaved=False):
    """Rotated (or, with transpose, back-rotated) q and k from one kernel launch."""
    q_out, k_out = _empty_bshd(q, unsqueeze_dim), _empty_bshd(k, unsqueeze_dim)
    q_v, k_v = _bshd(q, unsqueeze_dim), _bshd(k, unsqueeze_dim)  # [b, s, n, h_d]
    qo_v, ko_v = _bshd(q_out, unsqueeze_dim), _bshd(k_out, unsqueeze_dim)
    b, s, n_q, h_d = q_v.shape
    n_k, rot = k_v.shape[2], cos.shape[-1]
    if b * s == 0:
        return q_out, k_out
    if sin.stride() != cos.stride():  # the kernel reads both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    c_sb = cos.stride(0) if cos.shape[0] > 1 else 0  # [1, s, rot] serves every row
    block_q, block_k, block_half = _pow2(n_q), _pow2(n_k), _pow2(rot // 2)
    # Tokens per program: tiles of about _TILE q elements (one token of 16 heads x 128 dims on
    # GPUs; many tokens of the tests' tiny heads, which the interpreter runs per program).
    block_s = min(max(_TILE // (block_q * block_half), 1), _pow2(b * s))
    with _on_device(q):
        _kernel()[(-(-b * s // block_s),)](
            q, k, q_out, k_out, cos, sin, b * s, s, n_q, n_k,
            *q_v.stride(), *k_v.stride(), *qo_v.stride(), *ko_v.stride(),
            c_sb, cos.stride(1), cos.stride(2),
            HALF=rot // 2, PASS=h_d - rot, BLOCK_S=block_s, BLOCK_Q=block_q, BLOCK_K=block_k,
            BLOCK_HALF=block_half, BLOCK_PASS=_pow2(max(h_d - rot, 1)), TRANSPOSE=transpose,
            INTERLEAVED=interleaved,
        )  # fmt: skip
    return q_out, k_out


@torch.no_grad()
def _compile_backward(q, k, cos, sin, unsqueeze_dim, interleaved):
    """At the first forward of a shape, the backward variant launched on the first token, so
    that a failure to compile it shows (and falls back) there, not in `loss.backward()`."""
    n_q, n_k = _bshd(q, unsqueeze_dim).shape[2], _bshd(k, unsqueeze_dim).shape[2]
    # What the compiled variant depends on (not the length: a new one compiles nothing new).
    key = (q.device, q.dtype, k.dtype, n_q, n_k, q.shape[-1], cos.shape[-1], interleaved)
    if key in _state["compiled"]:
        return
    first = [x[:1, :, :1] if unsqueeze_dim == 1 else x[:1, :1] for x in (q, k)]  # one token
    _launch(*first, cos[:1, :1], sin[:1, :1], unsqueeze_dim, True, interleaved)
    _state["compiled"].add(key)


def _give_up(error, where, device_type):
    """A launch failed: re-raise an out-of-memory error (or any, under `STRICT_ENV`), else
    turn the kernel off for the process with one warning naming the error."""
    if isinstance(error, torch.cuda.OutOfMemoryError) or _strict():
        raise error
    _state["enabled"] = False
    warnings.warn(
        f"xtuner_rope: the Triton RoPE kernel failed in the {where} on {device_type} "
        f"({type(error).__name__}: {str(error)[:300]}); the eager kernel rotates from now on, "
        f"this call included (set {SWITCH_ENV}=0 or call use_triton_apply(False) to silence "
        "this).",
        RuntimeWarning,
        stacklevel=4,
    )


class TritonRotary(torch.autograd.Function):
    """q, k rotated by the kernel; the backward is the same kernel with the transpose, or the
    eager transpose where that launch fails."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim, ctx.interleaved = unsqueeze_dim, interleaved
        out = _launch(q, k, cos, sin, unsqueeze_dim, False, interleaved)
        _state["calls"] += 1
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        ud, interleaved = ctx.unsqueeze_dim, ctx.interleaved
        # The map is linear in q (and k): its vector-Jacobian product is its transpose.
        try:
            grads = _launch(grad_q, grad_k, cos, sin, ud, True, interleaved)
            _state["calls"] += 1
        except Exception as error:  # noqa: BLE001 - a failed launch must not stop training
            _give_up(error, "backward", grad_q.device.type)
            grads = [rotate_heads(g, cos, sin, ud, True, interleaved) for g in (grad_q, grad_k)]
        needs = ctx.needs_input_grad
        return grads[0] if needs[0] else None, grads[1] if needs[1] else None, *[None] * 4


def triton_apply(q, k, cos, sin, unsqueeze_dim, interleaved=False):
    """Rotate q and k with the Triton kernel; None if it failed and warned (eager takes over).

    Args:
        q (torch.Tensor): `[b, n_h, s, h_d]` (unsqueeze_dim 1) or `[b, s, n_h, h_d]` (2), any
            strides (InternLM2's views of its packed `wqkv` are read in place).
        k (torch.Tensor): `[b, n_kv, s, h_d]` or `[b, s, n_kv, h_d]`.
        cos, sin (torch.Tensor): fp32 `[b or 1, s, rot]`, rot even and <= h_d (partial rotary).
        interleaved (bool): Rotate the pairs (2i, 2i + 1) (Cohere) instead of (i, i + rot/2).

    Returns:
        tuple[torch.Tensor, torch.Tensor] | None: q, k rotated in their dtypes, laid out
        `[b, s, n, h_d]`.

    Raises:
        torch.cuda.OutOfMemoryError: Memory ran out (the kernel stays on).
        Exception: Any failure of the kernel, under `XTUNER_ROPE_TRITON_STRICT=1`.
    """
    where = "backward, compiled at the first forward"
    try:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            _compile_backward(q, k, cos, sin, unsqueeze_dim, bool(interleaved))
        where = "forward"
        return TritonRotary.apply(q, k, cos, sin, unsqueeze_dim, bool(interleaved))
    except Exception as error:  # noqa: BLE001 - a compile failure: keep training, eagerly
        _give_up(error, where, q.device.type)
        return None
