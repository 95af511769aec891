"""Packed attention against the live InternLM2 classes: the packed-equals-unpacked gold test."""

import copy

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from gqa_reference import causal_gqa_sdpa
from runners import tiny_runner
from torch import nn

from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.models.internlm2 import internlm2_attention_forward, patch_internlm2_attention
from xtuner_rope.models.internlm2_rope import ValidatedRotaryEmbedding
from xtuner_rope.ops.attention import MIN_BUCKET, packed_attention, plan_documents
from xtuner_rope.ops.packing import cumulative_from_lengths, plan_packs

LENGTHS = (1, 2, 3, 17, 64, 100)


def _docs(lengths, vocab=256):
    return [torch.randint(3, vocab, (n,)) for n in lengths]


def _alone(ref, doc):
    """Logits, summed shifted loss and its gradients of one document run alone, unpatched."""
    ref.zero_grad()
    logits = ref(input_ids=doc[None]).logits[0]  # [l, vocab]
    loss = F.cross_entropy(logits[:-1], doc[1:], reduction="sum") if len(doc) > 1 else None
    if loss is not None:
        loss.backward()
    grads = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in ref.named_parameters()
    }
    return logits.detach(), (0.0 if loss is None else loss.item()), grads


def _rows_of(docs, batch_size):
    """Deterministic packing of documents into ``batch_size`` rows (round robin)."""
    rows = [[] for _ in range(batch_size)]
    for i in range(len(docs)):
        rows[i % batch_size].append(i)
    return rows


@pytest.mark.parametrize("batch_size", [1, 2])
def test_packed_equals_unpacked_logits_loss_grads(tiny_model, batch_size):
    ref = tiny_model
    model = copy.deepcopy(ref)
    assert patch_internlm2_attention(model) == 2
    docs = _docs(LENGTHS)
    rows = _rows_of(docs, batch_size)
    instances = [
        dict(
            input_ids=torch.cat([docs[i] for i in row]).tolist(),
            labels=torch.cat([docs[i] for i in row]).tolist(),
            cumulative_len=cumulative_from_lengths([len(docs[i]) for i in row]).tolist(),
        )
        for row in rows
    ]
    batch = rope_collate_fn(instances, return_hf_format=True)
    out = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]
    )
    n_supervised = (batch["labels"][:, 1:] != -100).sum()
    (out.loss * n_supervised).backward()

    expected_loss, expected_grads = 0.0, None
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            logits, loss, grads = _alone(ref, docs[i])
            got = out.logits[r, offset : offset + len(docs[i])].detach()
            torch.testing.assert_close(got, logits, atol=1e-5, rtol=0)
            expected_loss += loss
            expected_grads = (
                grads
                if expected_grads is None
                else {n: expected_grads[n] + g for n, g in grads.items()}
            )
            offset += len(docs[i])
    torch.testing.assert_close(
        (out.loss * n_supervised).item(), expected_loss, rtol=1e-5, atol=1e-4
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_unpatched_model_leaks_across_documents(tiny_model):
    """The upstream behaviour we fix, measured on the same inputs: documents see each other."""
    docs = _docs((40, 40))
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(40), torch.arange(40)])[None]
    leaky = tiny_model(input_ids=ids, position_ids=pos).logits[0, 40:]
    alone = tiny_model(input_ids=docs[1][None]).logits[0]
    assert (leaky - alone).abs().max() > 1e-2
    patch_internlm2_attention(tiny_model)
    isolated = tiny_model(input_ids=ids, position_ids=pos).logits[0, 40:]
    torch.testing.assert_close(isolated, alone, atol=1e-5, rtol=0)


def test_hub_boundaries_isolate_without_position_resets(tiny_model):
    """Boundaries in XTuner's MessageHub convention win over position ids (bs 2)."""
    from mmengine import MessageHub

    ref = copy.deepcopy(tiny_model)
    patch_internlm2_attention(tiny_model)
    ids = torch.randint(3, 256, (2, 14))
    hub = MessageHub.get_instance("varlen_attn_args")
    # Flat boundaries over the [b * s] tokens: row 0 = 5 + 9 tokens, row 1 = 7 + 7.
    hub.update_info("cumulative_len_rank_0", torch.tensor([0, 5, 14, 21, 28], dtype=torch.int32))
    try:
        out = tiny_model(input_ids=ids).logits  # position ids default to 0..13 per row
    finally:
        hub.update_info("cumulative_len_rank_0", None)
    for r, start in ((0, 5), (1, 7)):
        alone = ref(input_ids=ids[r : r + 1, start:], position_ids=torch.arange(start, 14)[None])
        torch.testing.assert_close(out[r, start:], alone.logits[0], atol=1e-5, rtol=0)


def test_stale_hub_boundaries_are_refused(tiny_model):
    from mmengine import MessageHub

    patch_internlm2_attention(tiny_model)
    hub = MessageHub.get_instance("varlen_attn_args")
    hub.update_info("cumulative_len_rank_0", torch.tensor([0, 3, 10], dtype=torch.int32))
    try:
        with pytest.raises(ValueError, match=r"ending at 10.*b\*s = 1\*12 = 12 tokens"):
            tiny_model(input_ids=torch.randint(3, 256, (1, 12)))
    finally:
        hub.update_info("cumulative_len_rank_0", None)


def test_xtuner_packed_dataset_rows_match_documents_alone(tiny_tokenizer, sample_dialogues):
    """Rows from XTuner's own process_hf_dataset(pack_to_max_length=True) (cut documents too)."""
    from xtuner.dataset import process_hf_dataset
    from xtuner.dataset.map_fns import openai_map_fn, template_map_fn_factory
    from xtuner.utils import PROMPT_TEMPLATE

    from xtuner_rope.demo.tiny import build_tiny_internlm2

    dialogues = sample_dialogues[:40]
    packed = process_hf_dataset(
        dataset=Dataset.from_list(dialogues),
        tokenizer=tiny_tokenizer,
        max_length=128,
        dataset_map_fn=openai_map_fn,
        pack_to_max_length=True,
        use_varlen_attn=True,
        template_map_fn=template_map_fn_factory(template=PROMPT_TEMPLATE.internlm2_chat),
        remove_unused_columns=True,
        shuffle_before_pack=False,
        map_num_proc=1,
    )
    ref = build_tiny_internlm2(len(tiny_tokenizer), attn_implementation="sdpa")
    model = copy.deepcopy(ref)
    patch_internlm2_attention(model)
    batch = rope_collate_fn([packed[0], packed[1]], return_hf_format=True)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    for r, cu in enumerate(batch["cumulative_len"]):
        assert len(cu) >= 3, "expected several documents per XTuner-packed row"
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = ref(input_ids=batch["input_ids"][r : r + 1, start:end]).logits[0]
            torch.testing.assert_close(logits[r, start:end], alone, atol=1e-5, rtol=0)


def test_generation_with_kv_cache_matches_unpatched(tiny_model):
    ref = copy.deepcopy(tiny_model)
    patch_internlm2_attention(tiny_model)
    prompts = torch.randint(3, 256, (2, 9))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # left padding in the second prompt
    kwargs = dict(
        attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=True
    )
    torch.testing.assert_close(
        tiny_model.generate(prompts, **kwargs), ref.generate(prompts, **kwargs)
    )


def test_patch_is_idempotent_and_covers_wrappers(tiny_model):
    from peft import LoraConfig, get_peft_model

    assert patch_internlm2_attention(tiny_model) == 2
    assert patch_internlm2_attention(tiny_model) == 2
    attn = tiny_model.model.layers[0].attention
    assert isinstance(attn.rotary_emb, ValidatedRotaryEmbedding)
    assert attn.forward.__func__ is internlm2_attention_forward
    peft = get_peft_model(
        copy.deepcopy(tiny_model.__class__(tiny_model.config)),
        LoraConfig(r=4, target_modules=["wqkv"]),
    )
    assert patch_internlm2_attention(peft) == 2


def test_patch_refuses_models_without_internlm2_attention():
    with pytest.raises(ValueError, match=r"Linear contains no InternLM2 attention layer"):
        patch_internlm2_attention(nn.Linear(4, 4))


@pytest.mark.parametrize("lengths", [(1,), (1, 2, 3, 17, 64, 100), (16, 17, 33, 129, 1000, 1025)])
def test_plan_cost_grows_with_sum_of_squares(lengths):
    """Each document is padded by < 12.5% (to >= MIN_BUCKET): cost <= 1.27 sum(max(l,16)^2)."""
    plan = plan_documents(cumulative_from_lengths(lengths), torch.device("cpu"))
    cost = sum(b.gather.shape[0] * b.length**2 for b in plan.buckets)
    assert cost <= 1.125**2 * sum(max(n, MIN_BUCKET) ** 2 for n in lengths)
    assert sum(b.keep.numel() for b in plan.buckets) == sum(lengths)
    assert sorted(plan.inverse.tolist()) == list(range(sum(lengths)))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_packed_attention_matches_per_document_sdpa_forward_backward(backend):
    lengths, n_h, n_kv, h_d = (3, 30, 1, 17), 4, 2, 8
    t = sum(lengths)
    q = torch.randn(1, t, n_h, h_d, requires_grad=True)
    k = torch.randn(1, t, n_kv, h_d, requires_grad=True)
    v = torch.randn(1, t, n_kv, h_d, requires_grad=True)
    plan = plan_documents(cumulative_from_lengths(lengths), q.device)
    out = packed_attention(q, k, v, plan, backend)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    pieces, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        qd, kd, vd = (x[:, sl].transpose(1, 2) for x in (q, k, v))  # [1, heads, n, h_d]
        pieces.append(causal_gqa_sdpa(qd, kd, vd).transpose(1, 2))
        start += n
    expected = torch.cat(pieces, dim=1)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    for g, e in zip(got, torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_collate_pack_plan_rows_feed_patched_model(attn, tmp_path):
    """rope_collate_fn(pack=True) rows through the hub give each document's own logits: the
    model patched and the boundaries published by the plugin's hooks in a real Runner."""
    runner = tiny_runner(tmp_path, attn=attn)
    ref, model = copy.deepcopy(runner.model.llm), runner.model.llm
    lengths = LENGTHS  # the 1-token sample has no supervised label: kept and counted
    docs = _docs(lengths)
    batch = rope_collate_fn(
        [dict(input_ids=d.tolist(), labels=d.tolist()) for d in docs], pack=True, max_length=128
    )
    rows = plan_packs(list(lengths), 128)
    ValidatedRoPEHook().before_train(runner)
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    hook.before_train_iter(runner, 0, batch)
    try:
        logits = model(**batch["data"]).logits
    finally:
        hook.after_train_iter(runner, 0, batch)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            alone = ref(input_ids=docs[i][None]).logits[0]
            torch.testing.assert_close(
                logits[r, offset : offset + len(docs[i])], alone, atol=1e-5, rtol=0
            )
            offset += len(docs[i])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_or_sdpa_on_gpu_matches_documents_alone(tiny_model):
    model = copy.deepcopy(tiny_model).cuda().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    patch_internlm2_attention(model)
    docs = [d.cuda() for d in _docs(LENGTHS)]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n, device="cuda") for n in LENGTHS])[None]
    logits = model(input_ids=ids, position_ids=pos).logits[0]
    offset = 0
    for d in docs:
        alone = ref(input_ids=d[None]).logits[0]
        torch.testing.assert_close(logits[offset : offset + len(d)], alone, atol=3e-2, rtol=3e-2)
        offset += len(d)


def test_patched_model_matches_unpatched_on_plain_and_padded_batches(tiny_model):
    """Where upstream is right (one document per row), the patch changes nothing (fp32)."""
    ref = copy.deepcopy(tiny_model)
    patch_internlm2_attention(tiny_model)
    ids = torch.randint(3, 256, (2, 23))
    torch.testing.assert_close(
        tiny_model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-6, rtol=1e-5
    )
    # Right-padded rows from rope_collate_fn: the padding is its own segment for the patched
    # model, the attention mask does the same job for the reference.
    docs = _docs((23, 9))
    batch = rope_collate_fn(
        [dict(input_ids=d.tolist(), labels=d.tolist()) for d in docs], return_hf_format=True
    )
    got = tiny_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    want = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
    torch.testing.assert_close(got[1, :9], want[1, :9], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
