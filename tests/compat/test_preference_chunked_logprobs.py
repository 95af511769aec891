"""XTuner's own DPO and ORPO through the chunked target log-probs (``chunked_loss``).

The real ``xtuner.model.dpo.DPO`` / ``xtuner.model.orpo.ORPO`` on the tiny InternLM2, packed
(``use_varlen_attn``: pairs in one row, boundaries through XTuner's MessageHub) and unpacked
(a response per row, right-padded): one ``compute_loss`` with the model's full logits
(``chunked_loss = False``), then the same batch after ``hooks.chunked_loss.enable_chunked_loss``:
every loss-dict value and every trainable parameter's gradient within 1e-6 relative in fp32,
and no ``[tokens, vocab]`` tensor in the chunked step's forward or backward (the full step
holds one: the counter's control). Full DPO (a reference copy), LoRA DPO (the reference is the
policy without its adapter; LoRA on the head ``output`` too) and ORPO (its chosen NLL too).
Responses hold target id 0 (XTuner's mask dropped it: ``patch_xtuner_preference_target_zero``).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import preference_configs as pc
import pytest
import torch
from mmengine import MessageHub
from peft import LoraConfig
from vocab_tensors import VocabTensors
from xtuner.dataset.collate_fns.preference_collate_fn import preference_collate_fn
from xtuner.model.dpo import DPO
from xtuner.model.orpo import ORPO

from xtuner_rope import compat
from xtuner_rope.hooks.chunked_loss import enable_chunked_loss

CHUNK = 16  # tokens per chunk: several chunks per row


@pytest.fixture(scope="module")
def llm_cfg():
    compat.apply()
    return pc.tiny_llm_cfg()


def _pairs(n=3, seed=0):
    """``n`` pairs: a shared prompt (-100), chosen and rejected answers of other lengths."""
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(n):
        prompt = torch.randint(6, 1000, (5 + i,), generator=gen).tolist()
        chosen, rejected = (
            torch.randint(6, 1000, (m,), generator=gen).tolist() for m in (9 + 2 * i, 6 + 3 * i)
        )
        chosen[2] = rejected[1] = 0  # target id 0: an ordinary token
        pairs.append(
            {
                "chosen_ids": prompt + chosen,
                "chosen_labels": [-100] * len(prompt) + chosen,
                "rejected_ids": prompt + rejected,
                "rejected_labels": [-100] * len(prompt) + rejected,
            }
        )
    return pairs


def _batch(packed: bool) -> dict:
    pairs = _pairs()
    if not packed:
        return preference_collate_fn(pairs)["data"]
    ids, labels, positions, bounds = [], [], [], [0]
    for pair in pairs:
        for side in ("chosen", "rejected"):
            ids += pair[f"{side}_ids"]
            labels += pair[f"{side}_labels"]
            positions += list(range(len(pair[f"{side}_ids"])))
            bounds.append(len(ids))
    one = {"input_ids": ids, "labels": labels, "position_ids": positions, "cumulative_len": bounds}
    data = preference_collate_fn([one], use_varlen_attn=True)["data"]
    hub = MessageHub.get_instance("varlen_attn_args")  # as VarlenAttnArgsToMessageHubHook
    hub.update_info("cumulative_len_rank_0", data.pop("cumulative_len")[0])
    hub.update_info("max_seqlen_rank_0", data.pop("max_seqlen"))
    return data


def _step(model, packed):
    """One ``compute_loss`` and backward: the loss dict with XTuner's per-response log-prob
    sums (``logps``), the trainable gradients, the widest logits seen."""
    model.zero_grad(set_to_none=True)
    method = "get_var_len_atten_logps" if packed else "get_logps"
    own, sums = getattr(model, method), []

    def recorded(*args, **kwargs):
        sums.extend(own(*args, **kwargs))
        return sums

    setattr(model, method, recorded)
    with VocabTensors(model.llm.config.vocab_size) as seen:
        out = model.compute_loss(_batch(packed))
        out["loss"].mean().backward()  # MMEngine's parse_losses: the mean of a vector
    delattr(model, method)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {k: v.detach().clone() for k, v in out.items()}
    return {**out, "logps": torch.stack(sums).detach()}, grads, seen.rows


def _named(key):
    return lambda message: f"{key}: {message}"


def _model(kind, llm_cfg, packed):
    common = dict(llm=copy.deepcopy(llm_cfg), use_varlen_attn=packed)
    if kind == "orpo":
        return ORPO(**common, beta=0.1)
    if kind == "dpo_lora":
        lora = dict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=None)
        model = DPO(**common, lora=lora)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)  # B starts at 0: policy != reference
        assert "output" in model.llm.peft_config["default"].target_modules
        return model
    return DPO(**common, beta=0.1)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("kind", ["dpo", "dpo_lora", "orpo"])
def test_chunked_logprobs_give_xtuners_loss_and_gradients(llm_cfg, kind, packed):
    model = _model(kind, llm_cfg, packed)
    if kind == "dpo":  # a reference unlike the policy: the reference log-probs matter
        with torch.no_grad():
            for p in model.ref_llm.parameters():
                p.add_(torch.randn_like(p), alpha=0.02)
    tokens = _batch(packed)["input_ids"].numel()
    full, full_grads, full_rows = _step(model, packed)
    line = enable_chunked_loss(SimpleNamespace(cfg={"chunked_loss": CHUNK}, model=model))
    name = type(model).__name__
    assert f"chunked loss: {name}'s log-probs projects only the supervised tokens" in line, line
    assert f"chunks of {CHUNK} supervised tokens" in line
    got, got_grads, got_rows = _step(model, packed)
    assert full_rows >= tokens  # the full path's [b, s, V] logits (the counter's control)
    assert 0 < got_rows <= CHUNK  # chunked: no tensor of more than a chunk of V-sized rows
    torch.testing.assert_close(got["logps"], full["logps"], rtol=1e-6, atol=0)
    # The loss, rewards, margins, odds are functions of differences of those sums (each sum's
    # fp32 rounding ~1e-7 of its size, in either path): within 1e-6 of the sums' size.
    scale = float(full["logps"].abs().max())
    for key, want in full.items():
        torch.testing.assert_close(got[key], want, rtol=1e-6, atol=1e-6 * scale, msg=_named(key))
    assert got_grads.keys() == full_grads.keys() and len(got_grads) > 0
    for key, want in full_grads.items():
        atol = 1e-6 * float(want.abs().max())  # fp32 sums over tokens in another order
        torch.testing.assert_close(got_grads[key], want, rtol=1e-6, atol=atol, msg=_named(key))
