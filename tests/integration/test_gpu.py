"""What only a GPU can show: the real varlen kernel, every packed backend on CUDA in bf16 and
fp16, the failures first seen on GPUs, and a training step without a host sync. Skipped
without CUDA; run by tools/gpu/run_gpu.sh.
"""

import contextlib
import copy
import inspect
import math
from types import SimpleNamespace

import pytest
import torch
from gold import build_pair, check_packed_equals_alone
from varlen_reference import varlen_attn_2_10, varlen_attn_2_12

from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.models.internlm2_rope import ValidatedRotaryEmbedding
from xtuner_rope.ops import attention
from xtuner_rope.ops.attention import VarlenKernel, packed_backend
from xtuner_rope.ops.rope import apply_rotary_pos_emb

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
HALF = [torch.bfloat16, torch.float16]


def _torch_varlen():
    varlen = pytest.importorskip("torch.nn.attention.varlen", reason="needs torch >= 2.10")
    return varlen.varlen_attn


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n_kv", [4, 2])
def test_torch_varlen_attn_matches_the_reference_kernel(dtype, n_kv):
    """The CPU tests trust varlen_reference: here the real kernel is held to it, fwd + bwd."""
    varlen_attn = _torch_varlen()
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if n_kv != 4 and "enable_gqa" not in params:
        pytest.skip("this torch's varlen_attn has no GQA argument")
    gqa = {"enable_gqa": True} if n_kv != 4 else {}
    reference = varlen_attn_2_12 if "window_size" in params else varlen_attn_2_10
    lengths = [1, 7, 64, 200, 3]
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    t = sum(lengths)
    q, k, v = (
        torch.randn(t, n, 64, device="cuda", dtype=dtype, requires_grad=True)
        for n in (4, n_kv, n_kv)
    )
    out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **causal, **gqa)
    want = reference(q, k, v, cu, cu, max(lengths), max(lengths), **causal, **gqa)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    for g, w in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)
    ):
        torch.testing.assert_close(g.float(), w.float(), atol=3e-2, rtol=3e-2)


@pytest.fixture(params=["flash", "varlen", "buckets"])
def backend(request, monkeypatch):
    """Force one packed backend: flash-attn if installed, torch's varlen_attn, or the buckets."""
    if request.param == "flash":
        pytest.importorskip("flash_attn")
    else:
        monkeypatch.setattr(attention, "_flash_attn_installed", lambda: False)
    if request.param == "varlen":
        _torch_varlen()
    if request.param == "buckets":  # a varlen kernel that runs nowhere
        monkeypatch.setattr(attention, "VARLEN_KERNEL", VarlenKernel(lambda *a, **k: None, ()))
    return request.param


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    "family,attn", [("internlm2", "eager"), ("internlm2", "sdpa"), ("qwen2", "sdpa")]
)
def test_gold_on_cuda(backend, family, attn, dtype, bs):
    reference, model = build_pair(family, dtype, "cuda", attn)
    eager = attn == "eager" and family == "internlm2"
    expected = {"buckets": "eager" if eager else "sdpa"}.get(backend, backend)
    assert packed_backend(torch.zeros(1, device="cuda", dtype=dtype), eager) == expected
    check_packed_equals_alone(reference, model, bs, "cuda")


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("dtype", HALF)
def test_short_dialogue_batches_train_without_device_assert_or_nan(dtype, pack):
    """Dialogues of 1-100 tokens, packed and padded, forward + backward on CUDA."""
    _, model = build_pair("internlm2", dtype, "cuda")
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        lengths = torch.randint(1, 101, (16,), generator=gen).tolist()
        items = [
            dict(
                input_ids=torch.randint(3, 256, (n,), generator=gen).tolist(),
                labels=torch.randint(3, 256, (n,), generator=gen).tolist(),
            )
            for n in lengths
        ]
        if pack:
            data = rope_collate_fn(items, pack=True, max_length=256)["data"]
            data = {k: data[k] for k in ("input_ids", "labels", "position_ids")}
        else:
            data = rope_collate_fn(items, return_hf_format=True)
            data = {k: data[k] for k in ("input_ids", "labels", "position_ids")}
        out = model(**{k: v.cuda() for k, v in data.items()})
        out.loss.backward()
        torch.cuda.synchronize()  # a device-side assert surfaces here
        assert torch.isfinite(out.loss), (step, lengths)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()


def test_fp16_rotation_near_the_fp16_limit_on_cuda():
    """Pairs near 65504 whose exact rotation fits stay finite (upstream rounds then adds)."""
    values = torch.arange(45000, 47500, 32, dtype=torch.float32).half().unique()
    x1, x2 = values.repeat_interleave(len(values)), values.repeat(len(values))
    q = torch.stack((x1, x2), dim=-1)[None, None].cuda()  # [1, 1, s, 2]
    angle = torch.full((1, q.shape[2], 1), math.pi / 4, device="cuda")
    emb = torch.cat((angle, angle), dim=-1)  # [b, s, h_d]
    cos, sin = emb.cos().half(), emb.sin().half()
    ours, _ = apply_rotary_pos_emb(q, q, cos, sin)
    truth, _ = apply_rotary_pos_emb(q.double(), q.double(), cos.double(), sin.double())
    fits = truth.abs() <= torch.finfo(torch.float16).max
    assert torch.isfinite(ours[fits]).all()
    torch.testing.assert_close(ours[fits].double(), truth[fits], atol=0, rtol=1e-3)


@pytest.mark.parametrize("family", ["internlm2", "qwen2"])
def test_cpu_position_ids_with_cuda_activations(family):
    reference, model = build_pair(family, torch.bfloat16, "cuda")
    ids = torch.randint(3, 256, (1, 24), device="cuda")
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]  # on the CPU
    out = model(input_ids=ids, position_ids=pos).logits
    alone = reference(input_ids=ids[:, 10:]).logits
    torch.testing.assert_close(out[:, 10:].float(), alone.float(), atol=3e-2, rtol=3e-2)


def test_inv_freq_stays_fp32_after_cuda_bfloat16():
    rotary = ValidatedRotaryEmbedding(128, 8192)
    moved = copy.deepcopy(rotary).cuda().bfloat16()
    assert moved.inv_freq.dtype == torch.float32 and moved.inv_freq.is_cuda
    x = torch.randn(1, 1, 10, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(4090, 4100, device="cuda")[None]
    inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    freqs = torch.arange(4090, 4100).double()[:, None] * inv
    truth = torch.cat((freqs, freqs), dim=-1).cos()
    cos, _ = moved(x, pos)
    assert (cos[0].double().cpu() - truth).abs().max() < 1e-2  # bf16 output rounding only


@pytest.mark.parametrize("mode", ["published", "resets"])
def test_training_step_without_a_host_sync(mode, tmp_path):
    """Issue 58: XTuner's training step as a run takes it (the hook publishes the boundaries on
    the host, the data preprocessor moves the batch), forward and backward of the second step
    under ``torch.cuda.set_sync_debug_mode("error")``; bf16, dynamic NTK past 16 positions."""
    from host_sync import sync_debug_error
    from mmengine.config import ConfigDict
    from transformers import AutoModelForCausalLM
    from xtuner.model import SupervisedFinetune

    from xtuner_rope.demo.tiny import build_tiny
    from xtuner_rope.hooks.isolation import PackedBatchCheckHook
    from xtuner_rope.models import channel
    from xtuner_rope.models.dispatch import patch_model

    scaling = dict(type="dynamic", factor=2.0)
    build_tiny("internlm2", 256, max_position_embeddings=16, rope_scaling=scaling).save_pretrained(
        tmp_path
    )
    llm = dict(pretrained_model_name_or_path=str(tmp_path), torch_dtype=torch.bfloat16)
    sft = SupervisedFinetune(
        llm=ConfigDict(type=AutoModelForCausalLM.from_pretrained, trust_remote_code=True, **llm)
    )
    patch_model(sft)
    sft = sft.cuda().train()
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        items = []
        for n in (5, 17, 9, 30, 2, 1):
            ids = torch.randint(3, 256, (n,), generator=gen).tolist()
            items.append({"input_ids": ids, "labels": ids})
        data_batch = rope_collate_fn(items, pack=True, max_length=32)
        if mode == "resets":
            data_batch["data"].pop("cumulative_len")
        hook = PackedBatchCheckHook()
        hook.before_val(SimpleNamespace(model=sft))
        hook.before_val_iter(SimpleNamespace(model=sft), step, data_batch)
        data = sft.data_preprocessor(data_batch, True)["data"]  # the move, host copies kept
        torch.cuda.synchronize()
        try:
            with sync_debug_error() if step else contextlib.nullcontext():
                loss = sft(data, mode="loss")["loss"]
                loss.backward()
            torch.cuda.synchronize()
        finally:
            channel.clear()
        assert torch.isfinite(loss), step
