"""The chunked loss inside XTuner's ``LLaVAModel`` and ``InternVL_V1_5`` (``hooks.chunked_loss``).

The real XTuner classes on the tiny checkpoints (tiny CLIP or InternViT around a tiny InternLM2
with hub-style remote code), switched on as a run switches them (``enable_chunked_loss``), in
chunks of 5 tokens: a training forward's loss and the gradients of every trained parameter
(the LLM, LLaVA's projector, InternVL's ``mlp1``, LoRA adapters on the LLM and its head) equal
those of the same model with ``chunked_loss = False`` within 1e-6 relative in fp32, on rows
packed by our collate functions and padded by XTuner's. The LLM returns no logits and its head
never the whole rows ``[b, s, H]``: a bypassed chunked path fails the test.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from mmengine.config import ConfigDict
from multimodal_models import internvl_models, internvl_samples, llava_models, llava_samples
from peft import LoraConfig
from xtuner.dataset.collate_fns import default_collate_fn

from xtuner_rope import llava_collate_fn
from xtuner_rope.data.collate_internvl import internvl_collate_fn
from xtuner_rope.demo.tiny_clip import image_tokens
from xtuner_rope.hooks.chunked_loss import enable_chunked_loss
from xtuner_rope.hooks.isolation import PackedBatchCheckHook
from xtuner_rope.models import channel
from xtuner_rope.models.chunked_loss import causal_lm, is_chunked
from xtuner_rope.models.dispatch import language_model

# XTuner's stock LoRA (all linear layers, InternLM2's head ``output`` too), without dropout so
# that the two forwards draw nothing.
LORA = ConfigDict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM")


def _trained(model) -> None:
    """LoRA's B starts at 0 (A's gradient would be 0): give it values."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _pair(model, chunk: int = 5):
    """``model`` with the chunked loss in chunks of ``chunk`` tokens, and a copy with
    ``chunked_loss = False``; each with the logged line."""
    _trained(model)
    reference = copy.deepcopy(model)
    lines = [
        enable_chunked_loss(SimpleNamespace(cfg={"chunked_loss": setting}, model=m))
        for m, setting in ((model, chunk), (reference, False))
    ]
    assert "chunked loss: the training loss projects only" in lines[0], lines[0]
    assert f"chunks of {chunk} supervised tokens" in lines[0]
    assert "chunked_loss = False: the model's own loss" in lines[1], lines[1]
    assert is_chunked(language_model(model)) and not is_chunked(language_model(reference))
    return model.train(), reference.train()


def _step(model, data_batch: dict) -> tuple[torch.Tensor, dict, list]:
    """One training forward and backward: the loss, every gradient, what the LLM returned
    (``logits`` or None) and the shapes its head saw."""
    llm = causal_lm(language_model(model))
    head = llm.get_output_embeddings()
    seen: list = []
    hooks = [
        llm.register_forward_hook(lambda m, a, out: seen.append(("logits", out.logits))),
        head.register_forward_hook(lambda m, a, out: seen.append(("head", a[0].dim()))),
    ]
    hook, runner = PackedBatchCheckHook(), SimpleNamespace(model=model)
    hook.before_val(runner)
    hook.before_val_iter(runner, 0, data_batch)  # publishes a packed batch's boundaries
    model.zero_grad()
    try:
        loss = model(data_batch["data"], mode="loss")["loss"]
        loss.backward()
    finally:
        channel.clear()
        for h in hooks:
            h.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, seen


def _assert_equal(model, reference, batch) -> None:
    got, got_grads, seen = _step(model, batch())
    want, want_grads, seen_ref = _step(reference, batch())
    # The chunked path ran: no logits from the LLM, no [b, s, H] through the head (a plain
    # head's weight is used directly; a LoRA head module runs on [c, H] chunks).
    assert [v for k, v in seen if k == "logits"] == [None], seen
    assert {v for k, v in seen if k == "head"} <= {2}, seen
    assert [v is None for k, v in seen_ref if k == "logits"] == [False]
    assert {v for k, v in seen_ref if k == "head"} == {3}, seen_ref
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got_grads.keys() == want_grads.keys() and got_grads
    # 1e-6 relative over each gradient tensor (elements near 0 differ in the summation order).
    worst = max(
        float((g - want_grads[n]).norm() / want_grads[n].norm().clamp_min(1e-30))
        for n, g in got_grads.items()
    )
    print(f"loss relative error {abs(float(got / want - 1)):.2g}, gradients' worst {worst:.2g}")
    for name, g in got_grads.items():
        error = (g - want_grads[name]).norm() / want_grads[name].norm().clamp_min(1e-30)
        assert error <= 1e-6, (name, float(error))


@pytest.mark.parametrize(
    "packed, lora", [(True, False), (False, True)], ids=["packed-full", "padded-lora"]
)
def test_llava_chunked_loss_equals_the_models_own(tmp_path, packed, lora):
    options = {"llm_lora": LORA} if lora else {"freeze_llm": False}
    model, _ = llava_models(tmp_path, **options)
    model, reference = _pair(model)

    def batch():
        items = llava_samples(6, seed=3)
        if packed:
            return llava_collate_fn(items, max_length=200, image_tokens=image_tokens())
        return default_collate_fn(items)

    _assert_equal(model, reference, batch)
    names = list(dict(model.named_parameters()))
    assert any(n.startswith("projector.") for n in names)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    if lora:
        assert any("output.lora_A" in n for n in trained), trained
    else:
        assert any(n.startswith("llm.output") for n in trained), trained


@pytest.mark.parametrize(
    "packed, lora", [(True, False), (False, True)], ids=["packed-full", "padded-lora"]
)
def test_internvl_chunked_loss_equals_the_models_own(tmp_path, packed, lora):
    options = {"llm_lora": LORA} if lora else {"freeze_llm": False}
    model, _, (context, per_tile, side) = internvl_models(tmp_path, **options)
    model, reference = _pair(model)

    def batch():
        items = internvl_samples(6, 3, context, per_tile, side)
        if packed:
            return internvl_collate_fn(items, max_length=128)
        return default_collate_fn(items)

    _assert_equal(model, reference, batch)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(n.startswith("model.mlp1") for n in trained), trained
    assert any("output.lora_A" in n for n in trained) == lora, trained
