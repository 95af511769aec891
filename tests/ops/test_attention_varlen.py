"""The ``'varlen'`` packed backend (torch's ``varlen_attn``) on CPU, through its seam.

The real kernel runs only on CUDA; here ``attention.VARLEN_KERNEL`` holds a pure-torch kernel
with the same contract (``tests/varlen_reference.py``, both torch signatures), and the glue goes
through the same gold tests as the other backends: a packed batch gives each document what it
gets alone (logits, loss, gradients), InternLM2 and Llama/Qwen2, bs 1 and 2, GQA, in the half
dtypes the kernel takes. ``tests/test_gpu.py`` runs the real kernel against the reference.
"""

import functools
import importlib.util
import logging.handlers

import pytest
import torch
from gold import ROWS, build_pair, check_packed_equals_alone
from gqa_reference import causal_gqa_sdpa
from mmengine.logging import MMLogger
from varlen_reference import varlen_attn_2_10, varlen_attn_2_12

from xtuner_rope.models import runtime
from xtuner_rope.ops import attention
from xtuner_rope.ops.attention import VarlenKernel, packed_attention, packed_backend, plan_documents
from xtuner_rope.ops.packing import cumulative_from_lengths, flat_cumulative

KERNELS = {"2.12": varlen_attn_2_12, "2.10": varlen_attn_2_10}


@pytest.fixture(params=list(KERNELS))
def counted_kernel(request, monkeypatch):
    """The reference kernel of one signature, installed for CPU; ``.calls`` counts its calls."""
    reference = KERNELS[request.param]

    @functools.wraps(reference)  # keeps the signature the glue inspects
    def kernel(*args, **kwargs):
        kernel.calls += 1
        return reference(*args, **kwargs)

    kernel.calls = 0
    monkeypatch.setattr(attention, "VARLEN_KERNEL", VarlenKernel(kernel, ("cpu",)))
    return kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [1, 2])
def test_varlen_glue_matches_per_document_attention_fwd_bwd(counted_kernel, dtype, bs):
    """[b, s, n_h, h_d] in, GQA 4/2: fp32 per-document SDPA on the same inputs, fwd and bwd."""
    rows, n_h, n_kv, h_d = ROWS[:bs], 4, 2, 16
    s = sum(rows[0])
    q, k, v = (torch.randn(bs, s, n, h_d).to(dtype).requires_grad_() for n in (n_h, n_kv, n_kv))
    cu = flat_cumulative([cumulative_from_lengths(r) for r in rows], s)
    out = packed_attention(q, k, v, plan_documents(cu, q.device), "varlen")
    assert counted_kernel.calls == 1 and out.dtype == dtype and out.shape == q.shape
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    pieces = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        # [1, heads, n, h_d] slices of the flattened tokens
        qd, kd, vd = (
            x.reshape(bs * s, -1, h_d)[start:end].transpose(0, 1)[None] for x in (q32, k32, v32)
        )
        pieces.append(causal_gqa_sdpa(qd, kd, vd)[0].transpose(0, 1))
    expected = torch.cat(pieces).reshape(bs, s, n_h, h_d)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(out.float(), expected, **tol)
    for g, e in zip(got, torch.autograd.grad(expected, (q32, k32, v32), grad.float())):
        torch.testing.assert_close(g.float(), e, **tol)


def test_backend_choice_and_its_log(counted_kernel, monkeypatch):
    """varlen for half dtypes where the kernel runs; sdpa/eager otherwise; logged once."""
    monkeypatch.setattr(runtime, "_LOGGED", set())
    records = logging.handlers.BufferingHandler(capacity=100)
    logger = MMLogger.get_current_instance()
    logger.addHandler(records)
    assert runtime.choose_backend(torch.zeros(1, dtype=torch.bfloat16), eager=True) == "varlen"
    assert runtime.choose_backend(torch.zeros(1, dtype=torch.bfloat16), eager=True) == "varlen"
    assert runtime.choose_backend(torch.zeros(1, dtype=torch.float32), eager=False) == "sdpa"
    assert runtime.choose_backend(torch.zeros(1, dtype=torch.float32), eager=True) == "eager"
    logger.removeHandler(records)
    logged = [r.getMessage() for r in records.buffer]
    assert sum("'varlen' backend (cpu, torch.bfloat16)" in m for m in logged) == 1, logged


@pytest.mark.skipif(torch.__version__ < "2.10", reason="torch.nn.attention.varlen: torch >= 2.10")
def test_torch_kernel_is_cuda_only(monkeypatch):
    """Without the seam, CPU tensors never get torch's CUDA-only kernel."""
    monkeypatch.setattr(attention, "VARLEN_KERNEL", None)
    kernel = attention.varlen_kernel()
    assert kernel is not None and kernel.device_types == ("cuda",)
    assert packed_backend(torch.zeros(1, dtype=torch.bfloat16), eager=False) == "sdpa"


def test_varlen_without_torch_2_10_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(attention, "VARLEN_KERNEL", None)
    monkeypatch.setitem(__import__("sys").modules, "torch.nn.attention.varlen", None)
    # The lookup is cached per process: a fresh cache for this test, the real one after it.
    fresh = functools.lru_cache(maxsize=None)(attention._torch_varlen_kernel.__wrapped__)
    monkeypatch.setattr(attention, "_torch_varlen_kernel", fresh)
    assert attention.varlen_kernel() is None
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    plan = plan_documents(cumulative_from_lengths([4]), q.device)
    with pytest.raises(RuntimeError, match=r"needs torch >= 2.10.*use backend='sdpa'"):
        packed_attention(q, q, q, plan, "varlen")


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("family", ["internlm2", "qwen2"])
def test_packed_equals_documents_alone_through_varlen(counted_kernel, family, bs):
    """The gold test in bf16: logits, summed loss and gradients of the packed batch against
    the documents run alone through the unpatched model."""
    reference, model = build_pair(family, torch.bfloat16)
    check_packed_equals_alone(reference, model, bs)
    assert counted_kernel.calls == 2  # one call per layer: the integration took 'varlen'


def test_a_layer_call_looks_nothing_up(counted_kernel, monkeypatch):
    """Issue 58: the kernel's signature and flash-attn's presence are looked up once per
    process; every later layer call finds them in a dictionary."""
    signatures, specs = [], []
    real_signature, real_find_spec = attention.inspect.signature, importlib.util.find_spec
    monkeypatch.setattr(
        attention.inspect, "signature", lambda fn: signatures.append(fn) or real_signature(fn)
    )
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: specs.append(name) or real_find_spec(name)
    )
    monkeypatch.setattr(attention, "_KERNEL_PARAMS", {})
    fresh = functools.lru_cache(maxsize=None)(attention._flash_attn_installed.__wrapped__)
    monkeypatch.setattr(attention, "_flash_attn_installed", fresh)
    q = torch.randn(1, 16, 4, 8, dtype=torch.bfloat16)
    k = torch.randn(1, 16, 2, 8, dtype=torch.bfloat16)
    plan = plan_documents(cumulative_from_lengths([5, 11]), q.device)
    for _ in range(4):  # four layers
        packed_attention(q, k, k, plan, "varlen")
        attention._flash_attn_installed()
    assert counted_kernel.calls == 4
    assert len(signatures) == 1 and specs == ["flash_attn"], (signatures, specs)
