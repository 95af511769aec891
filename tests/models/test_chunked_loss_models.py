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
    model = _lora_internlm2(targets=("wqkv", "output"))
    reference = copy.deepcopy(model)
    assert "LoRA-adapted" in patch_chunked_loss(model, chunk_tokens=5)
    assert is_chunked(model) and not is_chunked(reference)
    got, got_grads = _loss_and_grads(model, chunked=True)
    want, want_grads = _loss_and_grads(reference, chunked=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert any("output.lora_A" in n for n in got_grads)
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _lora_internlm2(targets=("output",)):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets))
    model = get_peft_model(build_tiny("internlm2", VOCAB).train(), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # B starts at 0: a real adapter
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["linear", "lora"])
def test_a_zero3_partitioned_head_runs_the_loss_inside_its_modules_calls(lora):
    """ZeRO-3 (``ds_id`` on the head's weight): the loss runs as the head's call, nested in one
    call of each of its modules owning parameters (a LoRA head's base_layer, lora_A, lora_B), so
    DeepSpeed's hooks on them (pre-hooks here) fire once per forward, whatever the chunks, and
    no other module of the head runs; loss and gradients unchanged."""
    model = _lora_internlm2() if lora else build_tiny("internlm2", VOCAB).train()
    reference = copy.deepcopy(model)
    head = model.get_output_embeddings()
    (head.base_layer if lora else head).weight.ds_id = 7  # what DeepSpeed ZeRO-3 marks
    calls = []
    for name, module in head.named_modules():
        module.register_forward_pre_hook(lambda m, args, name=name: calls.append(name))
    patch_chunked_loss(model, chunk_tokens=5)
    got, got_grads = _loss_and_grads(model, chunked=True)
    owners = ["base_layer", "lora_A.default", "lora_B.default"] if lora else []
    assert calls == ["", *owners]
    assert all("forward" not in vars(m) for m in head.modules())  # given back
    want, want_grads = _loss_and_grads(reference, chunked=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


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
