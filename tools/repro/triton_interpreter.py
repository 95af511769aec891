"""The Triton RoPE kernel against the eager apply under Triton's interpreter, forward and backward.

12 cases (3 shapes, one with partial rotary; fp32 and bf16; heads-first and tokens-first
layouts), q, k and their gradients, with `XTUNER_ROPE_TRITON_INTERPRET=1`. Prints the Triton and
NumPy versions, `ops.rope_triton.interpreter_fault()` and the largest difference per dtype;
exits 1 if the kernel did not run or fp32 differs by more than 1e-5.

Written for Triton 3.0.0 (torch 2.4.1), whose interpreter reads wrong values with NumPy 2: run
it there with NumPy 1.26 first on the path (xtuner's datasets/pyarrow need NumPy 2, this
script imports neither), which shows the kernel itself computes on Triton 3.0:

Usage:
    uv pip install --target /tmp/np1 numpy==1.26.4
    PYTHONPATH=$PWD:/tmp/np1 .venv-compat-2.4.1-0.19.0/bin/python tools/repro/triton_interpreter.py
    PYTHONPATH=$PWD .venv/bin/python tools/repro/triton_interpreter.py   # Triton 3.9.0, NumPy 2
"""

import os
import sys

os.environ["XTUNER_ROPE_TRITON_INTERPRET"] = "1"
os.environ["TRITON_INTERPRET"] = "1"

import numpy  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from xtuner_rope.ops import rope_triton  # noqa: E402
from xtuner_rope.ops.rope import apply_rotary_pos_emb, cos_sin_at, inv_freq  # noqa: E402

SHAPES = [
    (2, 7, 4, 2, 8, 8),
    (1, 33, 3, 1, 16, 8),
    (3, 5, 2, 2, 32, 32),
]  # b, s, n_q, n_k, h_d, rot


def rotate(q0, k0, grads, cos, sin, unsqueeze_dim, kernel):
    """q, k rotated and their gradients, with the kernel or eagerly (fp32 copies)."""
    rope_triton.use_triton_apply(kernel)
    q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    calls = rope_triton.triton_kernel_calls()
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    torch.autograd.backward((q_out, k_out), grads)
    if rope_triton.triton_kernel_calls() - calls != (2 if kernel else 0):
        sys.exit("the Triton kernel did not run (interpreter_fault above)")
    return [t.detach().float() for t in (q_out, k_out, q.grad, k.grad)]


def main():
    fault = rope_triton.interpreter_fault()
    print(f"triton {triton.__version__}, numpy {numpy.__version__}, interpreter_fault: {fault}")
    worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for b, s, n_q, n_k, h_d, rot in SHAPES:
        for dtype in worst:
            for heads_first in (True, False):
                g = torch.Generator().manual_seed(0)
                shapes = [(b, n, s, h_d) if heads_first else (b, s, n, h_d) for n in (n_q, n_k)]
                q, k, grad_q, grad_k = (
                    torch.randn(*shapes[i % 2], generator=g).to(dtype) for i in range(4)
                )
                grads = (grad_q, grad_k)
                pos = torch.stack([torch.arange(s) % (3 + row) for row in range(b)])  # [b, s]
                cos, sin = cos_sin_at(pos, inv_freq(10000, rot), int(pos.max()))
                dim = 1 if heads_first else 2
                got = rotate(q, k, grads, cos, sin, dim, True)
                want = rotate(q, k, grads, cos, sin, dim, False)
                for a, e in zip(got, want):
                    worst[dtype] = max(worst[dtype], (a - e).abs().max().item())
    rope_triton.use_triton_apply(None)
    print(
        f"{len(SHAPES) * 4} cases, q, k, dq, dk: max |kernel - eager| fp32 "
        f"{worst[torch.float32]:.3g}, bf16 {worst[torch.bfloat16]:.3g} (one bf16 ulp at 4-8: 0.0312)"
    )
    sys.exit(0 if worst[torch.float32] <= 1e-5 else 1)


if __name__ == "__main__":
    main()
