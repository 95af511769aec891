"""Patched tiny models rotate through the Triton RoPE kernel (interpreted) as through eager.

Under `XTUNER_ROPE_TRITON_INTERPRET=1` the patched InternLM2 (its packed `wqkv` views) and
Llama / Qwen2 / Phi-3 layers rotate with the Triton kernel on CPU tensors; logits, loss and
every weight gradient of a packed batch (positions restarting per document, a different split
per row) must equal the eager kernel's within 1e-5 (fp32), dynamic NTK per document included.
Partial rotary is covered in tests/ops/test_rope_triton.py: transformers 4.48's Phi-3 rotates
the whole head.
"""

import pytest
import torch
import torch.nn.functional as F

from xtuner_rope.demo.tiny import build_tiny_hf, build_tiny_internlm2
from xtuner_rope.models.dispatch import patch_model
from xtuner_rope.ops.rope_triton import (
    INTERPRET_ENV,
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
}


def run(model, ids, pos):
    """Logits, loss and weight gradients of one packed forward/backward."""
    model.zero_grad()
    logits = model(input_ids=ids, position_ids=pos).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_patched_model_with_the_kernel_equals_eager(case, monkeypatch):
    family, overrides = CASES[case]
    if family == "internlm2":
        model = build_tiny_internlm2(VOCAB, attn_implementation="eager", **overrides)
    else:
        model = build_tiny_hf(family, VOCAB, attn_implementation="sdpa", **overrides)
    model = model.float().train()
    patch_model(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (len(DOCS), 12), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])  # [b, s]
    monkeypatch.setenv(INTERPRET_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel sets it; unset after the test
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
    torch.testing.assert_close(kernel[:2], eager[:2], atol=1e-5, rtol=1e-5)
    assert kernel[2].keys() == eager[2].keys()
    torch.testing.assert_close(kernel[2], eager[2], atol=1e-5, rtol=1e-5)
