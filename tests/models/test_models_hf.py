"""Gold tests of the Llama / Qwen2 / Mistral integration against live transformers models.

A packed batch through the patched model must give each document's logits, loss and
gradients as if it ran alone through the unpatched model; generation must not change.
"""

import copy

import peft
import pytest
import torch
import torch.nn.functional as F
from mmengine import MessageHub
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from xtuner_rope.models import (
    HFValidatedRotaryEmbedding,
    integration_for,
    is_patched_hf_attention,
    patch_hf_model,
)
from xtuner_rope.models.runtime import CUMULATIVE_KEY, VARLEN_HUB
from xtuner_rope.ops.packing import flat_cumulative

LLAMA3_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=64)),
}
ROWS = [[5, 9, 3], [7, 6, 4]]  # document lengths per row; every row holds 17 tokens


def build(family, attn, **overrides):
    """A tiny fp32 model of ``family`` (2 layers, hidden 64, GQA 4/2 heads, vocab 256)."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        attn_implementation=attn,
        **{**extra, **overrides},
    )
    torch.manual_seed(0)
    return model_cls(config).eval()


def packed_batch(bs):
    """input_ids, position_ids (reset per document), labels (XTuner's convention: -100 on the
    first token of every document after the first) and per-row boundaries."""
    rows = ROWS[:bs]
    ids = torch.randint(1, 256, (bs, sum(rows[0])))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    labels = ids.clone()
    labels[pos == 0] = -100
    labels[:, 0] = ids[:, 0]
    cus = [torch.tensor([0, *torch.tensor(row).cumsum(0).tolist()]) for row in rows]
    return ids, pos, labels, cus


def per_document(model, ids, rows):
    """Logits of each document run alone, in packed order, and the summed token loss."""
    logits, loss_sum = [], 0.0
    for r, row in enumerate(rows):
        start = 0
        for n in row:
            doc = ids[r : r + 1, start : start + n]
            out = model(doc).logits  # [1, n, vocab]
            loss_sum = loss_sum + F.cross_entropy(out[0, :-1], doc[0, 1:], reduction="sum")
            logits.append(out)
            start += n
    return torch.cat(logits, dim=1).view(len(rows), -1, logits[0].shape[-1]), loss_sum


@pytest.fixture
def publish():
    """Publish flat boundaries as PackedBatchCheckHook does; reset afterwards."""
    hub = MessageHub.get_instance(VARLEN_HUB)
    key = CUMULATIVE_KEY.format(rank=0)
    yield lambda cus, s: hub.update_info(key, flat_cumulative(cus, s))
    hub.update_info(key, None)


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("source", ["positions", "hub"])
def test_packed_equals_each_document_alone(family, attn, bs, source, publish):
    model = build(family, attn).train()
    reference = copy.deepcopy(model)
    assert patch_hf_model(model) == 2
    ids, pos, labels, cus = packed_batch(bs)
    if source == "hub":
        publish(cus, ids.shape[1])
    out = model(ids, position_ids=pos, labels=labels)
    ref_logits, ref_sum = per_document(reference, ids, ROWS[:bs])
    assert (out.logits - ref_logits).abs().max() <= 2e-5
    n_targets = sum(n - 1 for row in ROWS[:bs] for n in row)
    torch.testing.assert_close(out.loss, ref_sum / n_targets, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    (ref_sum / n_targets).backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_unpatched_model_leaks_across_documents(family, attn):
    # The negative control of the gold test above: without the patch the packed row differs.
    model = build(family, attn)
    ids, pos, _, _ = packed_batch(1)
    ref_logits, _ = per_document(model, ids, ROWS[:1])
    assert (model(ids, position_ids=pos).logits - ref_logits).abs().max() > 1e-2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_unchanged(family, attn):
    model = build(family, attn)
    reference = copy.deepcopy(model)
    patch_hf_model(model)
    ids = torch.randint(1, 256, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # row 1 left-padded
    for batch, attention_mask in ((ids[:1], mask[:1]), (ids, mask)):
        kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
        ours, theirs = model.generate(batch, **kwargs), reference.generate(batch, **kwargs)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_bfloat16_keeps_inv_freq_fp32_and_trains():
    model = build("qwen2", "sdpa").train()
    patch_hf_model(model)
    fresh = model.model.rotary_emb.inv_freq.clone()
    model.bfloat16()
    rotary = model.model.rotary_emb
    assert isinstance(rotary, HFValidatedRotaryEmbedding) and rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rotary.inv_freq, fresh, rtol=0, atol=0)
    ids, pos, labels, _ = packed_batch(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):  # fit the one packed batch: the loss must fall at every step
        out = model(ids, position_ids=pos, labels=labels)
        assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.8 * losses[0], losses
    # Training left the frequencies fp32 and untouched (a buffer, not a parameter).
    assert rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rotary.inv_freq, fresh, rtol=0, atol=0)


class _Wrapper(nn.Module):
    """Holds the model as ``.module`` as DDP / DeepSpeed engines do."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_patch_is_idempotent_and_finds_wrapped_models():
    model = build("mistral", "eager")
    wrapped = _Wrapper(nn.ModuleDict({"llm": model}))
    assert integration_for(wrapped) == "hf"
    assert patch_hf_model(wrapped) == 2
    rotary, config = model.model.rotary_emb, model.model.layers[0].self_attn.config
    assert patch_hf_model(model, max_position=128) == 2
    assert model.model.rotary_emb is rotary and rotary.limit()[0] == 128
    assert model.model.layers[1].self_attn.config is config
    assert model.config._attn_implementation == "eager"  # the model's own config is untouched
    assert all(is_patched_hf_attention(layer.self_attn) for layer in model.model.layers)


def test_patch_through_peft_lora():
    model = build("llama", "sdpa")
    reference = copy.deepcopy(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"]))
    assert patch_hf_model(lora) == 2
    ids, pos, _, _ = packed_batch(1)
    ref_logits, _ = per_document(reference, ids, ROWS[:1])
    assert (lora(input_ids=ids, position_ids=pos).logits - ref_logits).abs().max() <= 2e-5


def test_integration_for_other_models(tiny_model):
    assert integration_for(tiny_model) == "internlm2"
    assert integration_for(nn.Linear(2, 2)) is None


def test_refuses_models_without_a_supported_family(tiny_model):
    with pytest.raises(
        ValueError,
        match=r"InternLM2ForCausalLM contains no attention layer of "
        r"a supported family \(Llama",
    ):
        patch_hf_model(tiny_model)
    model = build("llama", "sdpa")
    del model.model.rotary_emb
    with pytest.raises(ValueError, match="LlamaAttention layers but no model-level rotary"):
        patch_hf_model(model)


def test_refuses_dropout_scaling_and_long_documents_in_packs():
    ids, pos, _, _ = packed_batch(1)
    model = build("llama", "sdpa", attention_dropout=0.1).train()
    patch_hf_model(model)
    with pytest.raises(ValueError, match="layer 0: attention dropout 0.1 is not supported"):
        model(ids, position_ids=pos)
    model = build("llama", "sdpa")
    patch_hf_model(model)
    model.model.layers[0].self_attn.scaling = 0.3
    with pytest.raises(ValueError, match=r"attention scaling 0.3 differs from head_dim \*\* -0.5"):
        model(ids, position_ids=pos)
    model = build("mistral", "sdpa", sliding_window=4)
    patch_hf_model(model)
    with pytest.raises(ValueError, match="document of 9 tokens is longer than the sliding window"):
        model(ids, position_ids=pos)


def test_refuses_bad_position_ids():
    model = build("llama", "eager")
    patch_hf_model(model)
    ids = torch.randint(1, 256, (1, 4))
    with pytest.raises(ValueError, match="must be non-negative, got -1 at row 0, column 2"):
        model(ids, position_ids=torch.tensor([[0, 1, -1, 2]]))
    with pytest.raises(
        ValueError,
        match=r"holds 256 at row 0, column 3, beyond the supported "
        r"range \[0, 256\) \(max_position_embeddings=256\)",
    ):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 256]]))


def test_gradient_checkpointing_keeps_documents_apart():
    model = build("qwen2", "sdpa").train()
    reference = copy.deepcopy(model)
    patch_hf_model(model)
    model.gradient_checkpointing_enable()
    ids, pos, labels, _ = packed_batch(2)
    ref_logits, _ = per_document(reference, ids, ROWS)
    assert (model(ids, position_ids=pos, labels=labels).logits - ref_logits).abs().max() <= 2e-5
