"""The packed-attention plan reads nothing back from the device when the batch carries its
boundaries, and builds length buckets only for the bucket backends.

On the CPU the "device" is ``meta`` (no values to read) under ``host_sync.NoHostSync``, which
fails at the first device-to-host copy, value read, data-dependent shape or blocking copy. On
CUDA the same runs under ``torch.cuda.set_sync_debug_mode("error")`` (skipped without CUDA; run
by ``tools/gpu/run_gpu.sh``).
"""

import pytest
import torch
from gold import ROWS, build_pair
from gqa_reference import causal_gqa_sdpa
from host_sync import HostSyncError, NoHostSync, sync_debug_error
from varlen_reference import varlen_attn_2_12

from xtuner_rope.models import channel
from xtuner_rope.ops import attention
from xtuner_rope.ops.attention import VarlenKernel, packed_attention, varlen_kernel
from xtuner_rope.ops.document_plan import document_plan, plan_documents
from xtuner_rope.ops.packing import cumulative_from_lengths, flat_cumulative
from xtuner_rope.ops.rope_documents import (
    document_lengths,
    host_document_lengths,
    per_token_inv_freq,
)

META = torch.device("meta")
S = 32  # every row of ROWS fills 32 tokens


def _host_boundaries(rows):
    """What the collate function and PackedBatchCheckHook leave: flat int32 on the CPU."""
    return flat_cumulative([cumulative_from_lengths(row) for row in rows], S)


def _positions(rows, device):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]).to(device)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("with_positions", [True, False])
def test_plan_from_host_boundaries_reads_nothing_back(bs, with_positions):
    rows = ROWS[:bs]
    cu = _host_boundaries(rows)
    positions = _positions(rows, META) if with_positions else None
    with NoHostSync() as mode:
        plan = document_plan(positions, bs, S, META, published=cu)
        again = document_plan(positions, bs, S, META, published=cu)  # the next layer
    assert mode.ops > 0  # the plan's ops ran inside the mode
    assert again is plan  # one plan per forward
    assert plan.cu_seqlens.device == META and plan.cu_seqlens.dtype == torch.int32
    assert plan.host_cu_seqlens.tolist() == cu.tolist()
    assert plan.max_seqlen == max(max(row) for row in rows)
    assert not plan.buckets_built


def test_bucket_indices_reach_the_device_without_a_sync():
    plan = plan_documents(_host_boundaries(ROWS), META)
    with NoHostSync():
        buckets, inverse = plan.buckets, plan.inverse
    assert plan.buckets_built
    assert inverse.device == META and inverse.shape == (2 * S,)
    assert all(b.gather.device == META and b.keep.device == META for b in buckets)


def test_the_position_fallback_is_caught_reading_the_device():
    """Without host boundaries the plan reads the position ids back: the check sees it (so it
    would see the same read re-added to the host-boundary path)."""
    positions = _positions(ROWS, META)
    with pytest.raises(HostSyncError, match=r"device-to-host copy .* from meta, shape \[2, 32\]"):
        with NoHostSync():
            document_plan(positions, 2, S, META)


@pytest.mark.parametrize(
    "read, why",
    [
        (lambda t: t.tolist(), "device-to-host copy"),
        (lambda t: int(t[0]), "value read to the host"),
        (lambda t: torch.unique(t), "output shape read from the device"),
        (lambda t: t[t > 0], "output shape read from the device"),
        (lambda t: torch.arange(3).to(t.device), "blocking host-to-device copy"),
    ],
)
def test_no_host_sync_catches_every_kind_of_read(read, why):
    with pytest.raises(HostSyncError, match=why):
        with NoHostSync():
            read(torch.zeros(4, dtype=torch.long, device=META))


def test_varlen_backend_builds_no_buckets(monkeypatch):
    monkeypatch.setattr(attention, "VARLEN_KERNEL", VarlenKernel(varlen_attn_2_12, ("cpu",)))
    q, k, v = (torch.randn(2, S, n, 8, dtype=torch.bfloat16) for n in (4, 2, 2))
    plan = document_plan(_positions(ROWS, "cpu"), 2, S, q.device, published=_host_boundaries(ROWS))
    varlen = packed_attention(q, k, v, plan, "varlen")
    assert not plan.buckets_built
    buckets = packed_attention(q, k, v, plan, "sdpa")
    assert plan.buckets_built
    torch.testing.assert_close(varlen.float(), buckets.float(), atol=2e-2, rtol=2e-2)


# ----- on CUDA: skipped without it, run by tools/gpu/run_gpu.sh -----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _per_document(q, k, v, rows):
    """Causal SDPA per document in fp32, ``[b, s, n_h, h_d]``."""
    out = []
    for r, row in enumerate(rows):
        start, pieces = 0, []
        for n in row:
            qd, kd, vd = (x[r, start : start + n].transpose(0, 1).float() for x in (q, k, v))
            o = causal_gqa_sdpa(qd, kd, vd)
            pieces.append(o.transpose(0, 1))  # [n, n_h, h_d]
            start += n
        out.append(torch.cat(pieces))
    return torch.stack(out)


@cuda
@pytest.mark.parametrize("backend", ["varlen", "sdpa", "eager"])
def test_cuda_packed_attention_without_a_host_sync(backend):
    """Plan, forward and backward of the packed attention under sync debug mode "error"."""
    if backend == "varlen" and varlen_kernel() is None:
        pytest.skip("torch's varlen_attn needs torch >= 2.10")
    q, k, v = (
        torch.randn(2, S, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for n in (4, 2, 2)
    )
    positions, cu = _positions(ROWS, "cuda"), _host_boundaries(ROWS)
    grad = torch.randn_like(q)
    with sync_debug_error():
        plan = document_plan(positions, 2, S, q.device, published=cu)
        out = packed_attention(q, k, v, plan, backend)
        got = torch.autograd.grad(out, (q, k, v), grad)
    assert plan.buckets_built == (backend != "varlen")
    want = _per_document(q, k, v, ROWS)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    for g, w in zip(got, torch.autograd.grad(want, (q, k, v), grad.float())):
        torch.testing.assert_close(g.float(), w.float(), atol=3e-2, rtol=3e-2)


@cuda
def test_cuda_training_forward_plans_without_a_host_sync():
    """A patched InternLM2's training forward (loss included) with the batch as it leaves the
    collate function (positions and boundaries on the host, published as PackedBatchCheckHook
    does) under sync debug mode "error"; the backward after it."""
    _, model = build_pair("internlm2", torch.bfloat16, "cuda")
    ids = torch.randint(3, 256, (2, S), device="cuda")
    positions, cu = _positions(ROWS, "cpu"), _host_boundaries(ROWS)
    channel.publish(cu, max(max(row) for row in ROWS), rank=0)
    try:
        with sync_debug_error():
            out = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)
    finally:
        channel.clear(rank=0)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_document_lengths_from_host_boundaries():
    """Host boundaries give each token's document length on the host, as the position ids do
    on the device; the per-token frequency index then reaches the device without a sync."""
    cu = _host_boundaries(ROWS)
    host = host_document_lengths(cu, 2, S)
    assert host.device.type == "cpu"
    assert host.tolist() == document_lengths(_positions(ROWS, "cpu"), cu, 2, S).tolist()
    base = torch.ones(4, device=META)
    with NoHostSync():
        freqs = per_token_inv_freq(
            host, base, 16, lambda n: torch.full((4,), 1.0 / n, device=META), META
        )
    assert freqs.device == META and freqs.shape == (2, S, 4)
