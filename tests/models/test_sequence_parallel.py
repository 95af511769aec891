"""Sequence parallel on packed rows: two gloo processes (sp = 2) compute what one does.

Two CPU processes form XTuner's sequence-parallel group (``init_sequence_parallel(2)``); each
embeds only its shard of a packed batch whose rows hold several documents, a collate padding
segment and (odd row length) the sequence-parallel padding segment. Checked against live
references, in fp32:

- the shards' logits, gathered, equal the patched model's on the whole batch in one process
  (sp = 1) and each document's logits alone through the unpatched model;
- the loss equals the one-process loss (XTuner's own ``outputs.loss``), every shard-boundary
  label included, and the gradients averaged over the two ranks (what DDP / DeepSpeed do)
  equal the one-process gradients;
- the chunked loss (``models.chunked_loss``) gives each rank the same loss and gradients as
  the full-logits shard loss, within 1e-6 relative, without calling the head; in bf16 (the
  first case) it is no further from that fp32 loss and those gradients than the full-logits
  loss in bf16 (measured: loss 1.17e-5 vs 1.18e-5, head 5.4e-3 vs 5.8e-3 on rank 0);
- XTuner 0.2.0's own ``_compute_sequence_parallel_loss`` does not (the dropped boundary
  label), which is what ``compat.patch_xtuner_sequence_parallel_loss`` replaces;
- no training forward after the first reads device data in the package's code (issue 58:
  ``host_sync.DeviceReads``, the batch moved as the data preprocessor moves it).

Cases: eager and SDPA attention classes, GQA with key/value heads divisible by sp (sent
through the all-to-all as they are) and not (repeated first, as XTuner does), and dynamic-NTK
checkpoints (each document gets the frequencies of its full-row length, on every shard).
"""

import contextlib
import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from xtuner_rope.compat.devices import gloo_all_to_all_missing

SP = 2
VOCAB = 256
ROWS = [[9, 17, 5], [30, 3]]  # documents per row; the longest row (33) is odd: sp padding
# Dynamic NTK past 16 positions: the 17- and 30-token documents get their own frequencies,
# from the full row's document lengths (a shard alone cannot see where its documents end).
DYNAMIC = dict(max_position_embeddings=16, rope_scaling=dict(type="dynamic", factor=4.0))
# (family, attention class, key/value heads of 4, config overrides)
CASES = [
    ("internlm2", "eager", 2, {}),
    ("internlm2", "sdpa", 2, {}),
    ("internlm2", "sdpa", 1, {}),
    ("llama", "sdpa", 2, {}),
    ("llama", "sdpa", 2, DYNAMIC),
    ("internlm2", "eager", 2, DYNAMIC),
]
TOL = dict(atol=1e-5, rtol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch():
    from xtuner_rope.data.collate import rope_collate_fn

    gen = torch.Generator().manual_seed(0)
    items, docs = [], []
    for row in ROWS:  # one XTuner-packed item per row, boundaries as cumulative_len
        row_docs = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in row]
        ids = sum(row_docs, [])
        cu = torch.tensor([0, *row]).cumsum(0).tolist()
        items.append({"input_ids": ids, "labels": ids, "cumulative_len": cu})
        docs.append(row_docs)
    return rope_collate_fn(items, return_hf_format=True), docs


def _reset_hub() -> None:
    from mmengine import MessageHub
    from mmengine.dist import get_rank

    from xtuner_rope.models.runtime import CUMULATIVE_KEY, MAX_SEQLEN_KEY, VARLEN_HUB

    hub = MessageHub.get_instance(VARLEN_HUB)
    hub.update_info(CUMULATIVE_KEY.format(rank=get_rank()), None)
    hub.update_info(MAX_SEQLEN_KEY.format(rank=get_rank()), None)


def _as_hook_leaves_it(data: dict) -> dict:
    from mmengine import MessageHub
    from mmengine.dist import get_rank

    from xtuner_rope.models.runtime import CUMULATIVE_KEY, VARLEN_HUB
    from xtuner_rope.ops.packing import flat_cumulative

    batch = dict(data)
    rows = batch.pop("cumulative_len")
    for key in ("max_seqlen", "num_unsupervised"):
        batch.pop(key)
    flat = flat_cumulative(rows, batch["input_ids"].shape[1])
    MessageHub.get_instance(VARLEN_HUB).update_info(CUMULATIVE_KEY.format(rank=get_rank()), flat)
    return batch


def _gather(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(SP)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)  # [b, S', ...] shards back in sequence order


def _check_case(family: str, attn: str, n_kv: int, overrides: dict, path: str, rank: int) -> None:
    from mmengine.config import ConfigDict
    from transformers import AutoModelForCausalLM
    from xtuner.model import SupervisedFinetune

    from xtuner_rope.demo.tiny import build_tiny
    from xtuner_rope.models.dispatch import patch_model
    from xtuner_rope.models.rope_documents import reset_upstream_rotaries
    from xtuner_rope.models.sequence_parallel import shard_rows

    reference = build_tiny(
        family,
        VOCAB,
        attn_implementation=attn,
        num_key_value_heads=n_kv,
        **copy.deepcopy(overrides),
    )
    # XTuner's model as the stock configs build it: activation checkpointing on (the backward
    # recomputes every layer's all-to-all and reads the published boundaries again).
    llm = ConfigDict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=path,
        attn_implementation=attn,
        trust_remote_code=True,
    )
    sft = SupervisedFinetune(llm=llm, use_activation_checkpointing=True)
    patch_model(sft)
    patched = sft.llm
    data, docs = _batch()
    b, s = data["input_ids"].shape

    # sp = 1: the whole batch in this process (eval mode: no sequence split).
    _reset_hub()
    patched.eval()
    one = patched(
        input_ids=data["input_ids"], position_ids=data["position_ids"], labels=data["labels"]
    )
    one.loss.backward()
    want_grads = {n: p.grad.clone() for n, p in patched.named_parameters()}
    patched.zero_grad()

    # sp = 2: this rank's shard only.
    patched.train()
    shard, _ = shard_rows(data, SP, rank)
    assert shard["input_ids"].shape == (b, (s + 1) // SP)
    logits = _gather(patched(**{k: shard[k] for k in ("input_ids", "position_ids")}).logits)
    torch.testing.assert_close(logits[:, :s], one.logits.detach(), **TOL)
    for r, row_docs in enumerate(docs):  # each document equals itself alone, unpatched
        start = 0
        for doc in row_docs:
            reset_upstream_rotaries(reference)  # dynamic NTK is stateful upstream
            alone = reference(input_ids=torch.tensor([doc])).logits[0]
            torch.testing.assert_close(logits[r, start : start + len(doc)], alone, **TOL)
            start += len(doc)

    # As in training: PackedBatchCheckHook publishes the collate's boundaries and takes them
    # out of the batch; SupervisedFinetune's sequence-parallel loss (compat's patch) runs.
    batch = _as_hook_leaves_it(data)
    sft.train()
    loss = sft(batch, mode="loss")["loss"]
    torch.testing.assert_close(loss, one.loss.detach(), **TOL)
    loss.backward()
    _reset_hub()
    rank_grads = {n: p.grad.clone() for n, p in patched.named_parameters()}
    for name, p in patched.named_parameters():  # the data-parallel average over both ranks
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / SP, want_grads[name], **TOL, msg=name)
    patched.zero_grad()
    _chunked_equals_full_logits(sft, data, loss.detach(), rank_grads)
    if (family, attn, overrides) == ("internlm2", "eager", {}):
        _bf16_no_further_than_full_logits(sft, data, loss.detach(), rank_grads)

    # XTuner 0.2.0's own method (what compat's patch wraps), on the same batch padded to an
    # even length and our attention: the label at each shard boundary is lost, the loss is off.
    xtuner_method = SupervisedFinetune._compute_sequence_parallel_loss.__wrapped__
    shard_rows(data, SP, rank)  # publishes the padded full-row boundaries
    padded = {
        k: F.pad(data[k], (0, 1), value=v)
        for k, v in (("input_ids", 0), ("labels", -100), ("position_ids", 0))
    }
    xtuner_loss = xtuner_method(sft, padded)["loss"].detach()
    _reset_hub()
    assert (xtuner_loss - one.loss.detach()).abs() > 1e-3, (xtuner_loss, one.loss)
    if overrides:  # dynamic NTK: the shard's per-document frequencies run too
        _forward_reads(sft, data)


def _chunked_equals_full_logits(sft, data: dict, loss: torch.Tensor, grads: dict) -> None:
    """The chunked loss (``models.chunked_loss``, chunks of 4 tokens) under sequence parallel:
    the same loss and this rank's own gradients as the full-logits shard loss within 1e-6, and
    the head never builds the shard's logits (its module is not called)."""
    from xtuner_rope.models.chunked_loss import loss_only, patch_chunked_loss

    llm = sft.llm
    patch_chunked_loss(llm, chunk_tokens=4)
    head = llm.get_output_embeddings()
    calls = []
    handle = head.register_forward_hook(lambda *args: calls.append(1))
    try:
        with loss_only():
            chunked = sft(_as_hook_leaves_it(data), mode="loss")["loss"]
        chunked.backward()
    finally:
        handle.remove()
        _reset_hub()
    assert calls == []
    torch.testing.assert_close(chunked.detach(), loss, rtol=1e-6, atol=0)
    for name, p in llm.named_parameters():
        want = grads[name]
        atol = 1e-6 * float(want.abs().max())
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=atol, msg=name)
    llm.zero_grad()


def _bf16_no_further_than_full_logits(sft, data: dict, loss: torch.Tensor, grads: dict) -> None:
    """In bf16 (a copy of the model) the chunked shard loss is no further from this rank's fp32
    full-logits loss and gradients than the full-logits loss in bf16 (norm-relative: the loss,
    the head's gradient, all gradients)."""
    from xtuner_rope.models.chunked_loss import is_chunked, loss_only

    model = copy.deepcopy(sft).to(torch.bfloat16)
    assert is_chunked(model.llm)  # by _chunked_equals_full_logits

    head, calls = model.llm.get_output_embeddings(), []
    head.register_forward_hook(lambda *args: calls.append(1))

    def run(chunked: bool) -> dict:
        calls.clear()
        with loss_only() if chunked else contextlib.nullcontext():
            got = model(_as_hook_leaves_it(data), mode="loss")["loss"]
        assert len(calls) == (0 if chunked else 1)  # chunked: the head builds no logits
        got.backward()
        _reset_hub()
        out = {"loss": got.detach(), **{n: p.grad for n, p in model.llm.named_parameters()}}
        model.zero_grad()
        return out

    def views(run: dict) -> dict:
        flat = torch.cat([run[n].double().flatten() for n in grads])
        return {"loss": run["loss"].double(), "head": run["output.weight"].double(), "all": flat}

    want = views({"loss": loss, **grads})
    ours, full = views(run(True)), views(run(False))
    errors = {
        k: [float((got[k] - w).norm() / w.norm()) for got in (ours, full)] for k, w in want.items()
    }
    for name, (err_ours, err_full) in errors.items():
        assert err_ours <= err_full * 1.05 + 1e-7, (name, errors)


def _forward_reads(sft, data: dict) -> None:
    """Issue 58: three training forwards of this rank's shard, as in a run (the hook publishes
    the host boundaries, the data preprocessor moves the batch and remembers its host copies):
    the package's code reads no device data in any forward after the first, on either rank,
    with the full-logits loss and with the chunked loss (the shard's labels read on the host)."""
    from contextlib import nullcontext

    from host_sync import DeviceReads, preprocessor_move

    from xtuner_rope.models.chunked_loss import is_chunked, loss_only
    from xtuner_rope.ops.host_copies import forget_host_copies

    assert is_chunked(sft.llm)  # by _chunked_equals_full_logits
    for chunked in (False, True):
        per_forward = []
        for _ in range(3):
            batch = _as_hook_leaves_it(data)
            reads = DeviceReads()
            reads.on_device(list(sft.parameters()), list(sft.buffers()))
            moved = preprocessor_move(batch, reads)
            try:
                with reads, loss_only() if chunked else nullcontext():
                    loss = sft(moved, mode="loss")["loss"]
                loss.backward()
            finally:
                _reset_hub()
                forget_host_copies()
            sft.zero_grad()
            assert reads.calls > 300
            per_forward.append(reads.reads)
        found = torch.tensor([sum(map(len, per_forward[1:]))])
        dist.all_reduce(found)  # both ranks pass or fail together (no rank left waiting)
        assert int(found) == 0, (chunked, per_forward)


def _worker(rank: int, port: int, paths: list[str]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(SP)
    )
    torch.set_num_threads(1)
    import xtuner_rope

    xtuner_rope.activate()  # a spawned process starts bare: the plugin's patches, as a run has
    dist.init_process_group("gloo", rank=rank, world_size=SP)
    try:
        from xtuner.parallel.sequence import init_sequence_parallel

        init_sequence_parallel(SP)
        for case, path in zip(CASES, paths):
            _check_case(*case, path, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(gloo_all_to_all_missing() is not None, reason=str(gloo_all_to_all_missing()))
def test_sequence_parallel_equals_one_rank_and_documents_alone(tmp_path):
    from xtuner_rope.demo.tiny import build_tiny

    paths = []
    for i, (family, attn, n_kv, overrides) in enumerate(CASES):  # loaded as XTuner's llm=dict
        path = tmp_path / f"{i}-{family}-{attn}-{n_kv}"
        build_tiny(  # transformers' configs write into rope_scaling: each gets its own copy
            family,
            VOCAB,
            attn_implementation=attn,
            num_key_value_heads=n_kv,
            **copy.deepcopy(overrides),
        ).save_pretrained(path)
        paths.append(str(path))
    mp.spawn(_worker, args=(_free_port(), paths), nprocs=SP, join=True)
