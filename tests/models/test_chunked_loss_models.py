"""The chunked loss inside the tiny models (``models.chunked_loss``): a patched model called with
``labels`` inside ``loss_only`` returns the unpatched model's loss and gradients (fp32, 1e-6
relative), no logits; outside the block, or without labels, it is the model's own forward."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from xtuner_rope.demo.tiny import build_tiny
from xtuner_rope.models.chunked_loss import (
    UnsupportedHead,
    is_chunked,
    loss_only,
    patch_chunked_loss,
)
from xtuner_rope.models.dispatch import patch_model

VOCAB = 97


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    labels[1, 15:] = -100  # padding
    return ids, labels


def _loss_and_grads(model, chunked):
    ids, labels = _batch()
    model.zero_grad()
    if chunked:
        with loss_only():
            out = model(input_ids=ids, labels=labels, return_dict=True)
        assert out.logits is None
    else:
        out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("internlm2", {}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("cohere", {"logit_scale": 0.125}),
        ("llama", {}),
    ],
)
def test_patched_model_gives_the_models_loss_and_gradients(family, overrides):
    model = build_tiny(family, VOCAB, attn_implementation="sdpa", **overrides).train()
    patch_model(model)
    reference = copy.deepcopy(model)
    what = patch_chunked_loss(model, chunk_tokens=7)
    assert "chunks of 7 supervised tokens" in what
    if overrides.get("tie_word_embeddings"):
        assert "tied to the input embeddings" in what
    if "logit_scale" in overrides:
        assert "logit scale 0.125" in what
    got, got_grads = _loss_and_grads(model, chunked=True)
    want, want_grads = _loss_and_grads(reference, chunked=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_outside_loss_only_and_without_labels_the_model_is_its_own():
    model = build_tiny("internlm2", VOCAB).train()
    patch_chunked_loss(model)
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)  # e.g. DPO reads the logits of such a call
    assert out.logits.shape == (2, 24, VOCAB) and out.loss is not None
    with loss_only():
        assert model(input_ids=ids).logits.shape == (2, 24, VOCAB)  # predict / generation


def test_lora_on_the_head_goes_through_peft():
    """XTuner's stock InternLM2 LoRA adapts ``output``: peft calls the patched forward."""
    base = build_tiny("internlm2", VOCAB).train()
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["wqkv", "output"])
    model = get_peft_model(base, config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    reference = copy.deepcopy(model)
    assert "LoRA-adapted" in patch_chunked_loss(model, chunk_tokens=5)
    assert is_chunked(model) and not is_chunked(reference)
    got, got_grads = _loss_and_grads(model, chunked=True)
    want, want_grads = _loss_and_grads(reference, chunked=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert any("output.lora_A" in n for n in got_grads)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_zero3_partitioned_head_runs_the_loss_as_its_own_call():
    """ZeRO-3 (``ds_id`` on the head's weight): the loss runs as the head module's call, so
    DeepSpeed's hooks on the head (a pre-hook here) fire once per forward, whatever the chunks;
    loss and gradients unchanged. A partitioned LoRA head is refused (its modules would gather
    once per chunk)."""
    model = build_tiny("internlm2", VOCAB).train()
    reference = copy.deepcopy(model)
    model.output.weight.ds_id = 7  # what DeepSpeed ZeRO-3 marks a partitioned parameter with
    calls = []
    model.output.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    patch_chunked_loss(model, chunk_tokens=5)
    got, got_grads = _loss_and_grads(model, chunked=True)
    assert calls == [torch.Size([2, 24, 64])] and "forward" not in vars(model.output)
    want, want_grads = _loss_and_grads(reference, chunked=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    lora = get_peft_model(build_tiny("internlm2", VOCAB), LoraConfig(target_modules=["output"]))
    lora.base_model.model.output.base_layer.weight.ds_id = 7
    with pytest.raises(UnsupportedHead, match="LoRA-adapted nn.Linear.*partitioned by DeepSpeed"):
        patch_chunked_loss(lora)


def test_a_head_it_does_not_know_is_refused_with_why():
    model = build_tiny("internlm2", VOCAB)
    model.output = torch.nn.Sequential(model.output)
    with pytest.raises(UnsupportedHead, match="head: Sequential is not a plain nn.Linear"):
        patch_chunked_loss(model)
    assert not is_chunked(model)
    moe = build_tiny("internlm2", VOCAB)
    moe.config.output_router_logits = True
    with pytest.raises(UnsupportedHead, match="adds the router's auxiliary loss"):
        patch_chunked_loss(moe)


def test_paused_the_model_gives_its_own_logits_inside_loss_only():
    """What reads a training forward's logits (the isolation capture) pauses the chunked loss."""
    from xtuner_rope.models.chunked_loss import pause_chunked_loss

    model = build_tiny("internlm2", VOCAB).train()
    patch_chunked_loss(model)
    ids, labels = _batch()
    resume = pause_chunked_loss(model)
    with loss_only():
        paused = model(input_ids=ids, labels=labels)
    resume()
    with loss_only():
        chunked = model(input_ids=ids, labels=labels)
    assert paused.logits.shape == (2, 24, VOCAB) and chunked.logits is None
    torch.testing.assert_close(chunked.loss, paused.loss, rtol=1e-6, atol=0)
    assert pause_chunked_loss(build_tiny("internlm2", VOCAB))() is None  # unpatched: nothing


def test_a_patched_model_generates_as_before():
    """``generate()`` reads ``forward``'s signature (``num_logits_to_keep``): Phi-3's step fed
    ``-None`` when the chunked forward hid it."""
    model = build_tiny("phi3", VOCAB).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    before = model.generate(ids, max_new_tokens=4, do_sample=False)
    patch_chunked_loss(model)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), before)
