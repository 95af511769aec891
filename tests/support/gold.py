"""The packed-equals-alone gold check, for any device, dtype and packed backend.

A packed batch through the patched model must give each document the logits, summed loss and
gradients it gets alone through the unpatched model. Used by test_attention_varlen.py (CPU,
reference varlen kernel) and test_gpu.py (CUDA, every backend).
"""

import copy

import torch
import torch.nn.functional as F

from xtuner_rope.demo.tiny import build_tiny_hf, build_tiny_internlm2
from xtuner_rope.models.dispatch import patch_model

ROWS = [[1, 5, 17, 9], [30, 2]]  # documents per row (32 tokens each)
# Half-precision tolerances: two kernels round differently (fp32 runs match to ~1e-5).
LOGITS_TOL = dict(atol=3e-2, rtol=3e-2)
GRAD_TOL = 3e-2  # of the largest gradient entry of each parameter


def build_pair(family, dtype, device="cpu", attn="sdpa"):
    """A tiny model (2 layers, GQA 4/2) in ``dtype`` on ``device``, and its patched copy."""
    if family == "internlm2":
        model = build_tiny_internlm2(256, attn_implementation=attn)
    else:
        model = build_tiny_hf(family, 256, attn_implementation=attn)
    model = model.to(device, dtype).train()
    patched = copy.deepcopy(model)
    count, _ = patch_model(patched)
    assert count == 2
    return model, patched


def check_packed_equals_alone(reference, model, bs, device="cpu"):
    """Run ``bs`` rows of ``ROWS`` packed through ``model`` and each document alone through
    ``reference``; assert logits, summed loss and gradients agree within half tolerances."""
    rows = ROWS[:bs]
    docs = [[torch.randint(3, 256, (n,), device=device) for n in row] for row in rows]
    ids = torch.stack([torch.cat(row) for row in docs])  # [b, s]
    pos = torch.stack([torch.cat([torch.arange(n, device=device) for n in row]) for row in rows])
    logits = model(input_ids=ids, position_ids=pos).logits  # [b, s, vocab]
    loss, expected_loss = 0.0, 0.0
    for r, row in enumerate(docs):
        start = 0
        for doc in row:
            got = logits[r, start : start + len(doc)]
            want = reference(input_ids=doc[None]).logits[0]
            torch.testing.assert_close(got.float(), want.float(), **LOGITS_TOL)
            loss = loss + F.cross_entropy(got[:-1].float(), doc[1:], reduction="sum")
            expected_loss = expected_loss + F.cross_entropy(
                want[:-1].float(), doc[1:], reduction="sum"
            )
            start += len(doc)
    torch.testing.assert_close(loss, expected_loss, rtol=5e-3, atol=5e-2)
    loss.backward()
    expected_loss.backward()
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        scale = ref_p.grad.float().abs().max().clamp(min=1e-3)
        assert (p.grad.float() - ref_p.grad.float()).abs().max() <= GRAD_TOL * scale, name
