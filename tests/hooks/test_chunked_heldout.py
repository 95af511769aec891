"""The held-out metrics of LLaVA, InternVL, DPO and ORPO through the chunked target log-probs.

XTuner's real ``LLaVAModel``, ``InternVL_V1_5``, ``DPO`` (full, LoRA) and ``ORPO`` on the tiny
checkpoints, switched on as a run switches them (``hooks.chunked_loss.enable_chunked_loss``, chunks of 5 tokens), and a
copy with ``chunked_loss = False``: one packed held-out batch through ``val_step`` as MMEngine's
``ValLoop`` runs it (``PackedBatchCheckHook`` publishes the boundaries) into ``TokenLossMetric``
(LLaVA, InternVL: per-dialogue NLL, the worst-dialogues file) or ``PreferenceMetric`` (the
policy's and DPO's reference's log-prob sum of each response). The chunked outputs hold no logits and
no ``[*, V]`` tensor of more than a chunk is built (the full copy's are the rows': the counter's
control); every figure equals the full logits' within 1e-6 relative.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import preference_configs as pc
import pytest
import torch
from multimodal_models import internvl_models, internvl_samples, llava_models, llava_samples
from vocab_tensors import VocabTensors
from xtuner.dataset.collate_fns.preference_collate_fn import preference_collate_fn

from xtuner_rope import compat, internvl_collate_fn, llava_collate_fn
from xtuner_rope.demo.tiny_clip import image_tokens
from xtuner_rope.evaluation.metric import WORST_FILE, TokenLossMetric
from xtuner_rope.evaluation.preference_metric import PreferenceMetric
from xtuner_rope.hooks import PackedBatchCheckHook
from xtuner_rope.hooks.chunked_loss import enable_chunked_loss
from xtuner_rope.models.chunked_loss import causal_lm
from xtuner_rope.models.dispatch import language_model

CHUNK = 5
HELD_OUT_LINE = "the held-out log-probs too; opt out: chunked_loss = False"


def _pair(model):
    """``model`` with the chunked loss in chunks of ``CHUNK``, and a copy without it."""
    reference = copy.deepcopy(model)
    line = enable_chunked_loss(SimpleNamespace(cfg={"chunked_loss": CHUNK}, model=model))
    assert HELD_OUT_LINE in line, line
    off = enable_chunked_loss(SimpleNamespace(cfg={"chunked_loss": False}, model=reference))
    assert "chunked_loss = False: the model's own loss (full logits) runs" in off, off
    return model, reference


def _val(model, metric, batch) -> tuple[list, int]:
    """``val_step`` and ``metric.process`` on one batch as ``ValLoop`` runs them: the outputs
    and the most ``[*, V]`` rows any tensor of the step held."""
    vocab = causal_lm(language_model(model)).config.vocab_size
    hook, runner = PackedBatchCheckHook(), SimpleNamespace(model=model)
    hook.before_val(runner)
    hook.before_val_iter(runner, 0, batch)
    try:
        with torch.no_grad(), VocabTensors(vocab) as seen:
            outputs = model.val_step(batch)
        metric.process(batch, outputs)
    finally:
        hook.after_val_iter(runner, 0, batch)
    return outputs, seen.rows


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-6 * abs(want)


def _token_loss(model, batch, work) -> tuple[list, list, list, int]:
    """The per-sample documents, worst-dialogues file, outputs and widest logits."""
    metric = TokenLossMetric(worst=3)
    metric.output_dir = str(work)
    work.mkdir()
    outputs, rows = _val(model, metric, batch)
    metric.compute_metrics(metric.results)
    docs = [d for result in metric.results for d in result["documents"]]
    worst = [json.loads(x) for x in (work / WORST_FILE).read_text().splitlines()]
    return docs, worst, outputs, rows


@pytest.mark.parametrize("kind", ["llava", "internvl"])
def test_multimodal_heldout_from_the_chunked_log_probs_equals_the_full_logits(tmp_path, kind):
    if kind == "llava":
        model = llava_models(tmp_path)[0]
        items = llava_samples(6, seed=3)

        def batch():
            return llava_collate_fn(items, max_length=200, image_tokens=image_tokens())
    else:
        model, _, (context, per_tile, side) = internvl_models(tmp_path)
        items = internvl_samples(6, 3, context, per_tile, side)

        def batch():
            return internvl_collate_fn(items, max_length=128)

    model, reference = _pair(model)
    got = _token_loss(model, batch(), tmp_path / "chunked")
    want = _token_loss(reference, batch(), tmp_path / "full")
    tokens = batch()["data"]["input_ids"].numel()
    assert 0 < got[3] <= CHUNK and want[3] >= tokens, (got[3], want[3])
    assert all("target_logprobs" in row and "logits" not in row for row in got[2])
    assert all(row["logits"].dim() == 2 for row in want[2])  # the opt-out: full logits
    assert len(got[0]) == len(want[0]) >= 4
    for g, w in zip(got[0], want[0]):
        assert g["tokens"] == w["tokens"] and g["first_ids"] == w["first_ids"]
        assert _close(g["nll"], w["nll"]), (g, w)
    assert [{**g, "mean_nll": 0} for g in got[1]] == [{**w, "mean_nll": 0} for w in want[1]]
    assert all(_close(g["mean_nll"], w["mean_nll"]) for g, w in zip(got[1], want[1]))


def _preference_model(kind):
    """XTuner's DPO (a reference unlike the policy), LoRA DPO (the reference: the policy
    without its adapter, on the head ``output`` too) or ORPO, on packed pairs."""
    from peft import LoraConfig
    from xtuner.model.dpo import DPO
    from xtuner.model.orpo import ORPO

    compat.apply()
    common = dict(llm=pc.tiny_llm_cfg(), use_varlen_attn=True, beta=0.1)
    if kind == "orpo":
        return ORPO(**common).eval()
    if kind == "dpo":
        model = DPO(**common).eval()
        with torch.no_grad():
            for p in model.ref_llm.parameters():
                p.add_(torch.randn_like(p), alpha=0.02)
        return model
    lora = dict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=None)
    model = DPO(**common, lora=lora).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # B starts at 0: policy != reference
    return model


@pytest.mark.parametrize("kind", ["dpo", "dpo_lora", "orpo"])
def test_preference_heldout_from_the_chunked_log_probs_equals_the_full_logits(kind):
    """Packed pairs (as the stock configs); ``PreferenceMetric``'s per-response log-prob sums."""
    model, reference = _pair(_preference_model(kind))
    gen = torch.Generator().manual_seed(0)
    ids, labels, positions, bounds = [], [], [], [0]
    for n, m in ((5, 9), (7, 6), (4, 12), (6, 8)):  # prompt, answer lengths of each response
        answer = torch.randint(6, 1000, (n + m,), generator=gen)
        answer[n + 1] = 0  # target id 0 counts (compat.patch_xtuner_preference_target_zero)
        ids += answer.tolist()
        labels += [-100] * n + answer[n:].tolist()
        positions += list(range(n + m))
        bounds.append(len(ids))
    one = {"input_ids": ids, "labels": labels, "position_ids": positions, "cumulative_len": bounds}
    results = {}
    for name, m in (("chunked", model), ("full", reference)):
        metric = PreferenceMetric()
        metric.bind(m)
        batch = preference_collate_fn([one], use_varlen_attn=True)
        outputs, rows = _val(m, metric, batch)
        results[name] = (metric.results, metric.compute_metrics(metric.results), outputs, rows)
    got, want = results["chunked"], results["full"]
    assert 0 < got[3] <= CHUNK and want[3] >= len(ids), (got[3], want[3])
    ref = ["ref_"] if kind != "orpo" else []
    assert sorted(got[2][0]) == [f"{p}target_logprobs" for p in ref + [""]], sorted(got[2][0])
    assert sorted(want[2][0]) == ["logits"] + [f"{p}logits" for p in ref]
    pairs = [(g, w) for r, s in zip(got[0], want[0]) for g, w in zip(r["pairs"], s["pairs"])]
    assert len(pairs) == 2
    for g, w in (x for pair in pairs for x in zip(*pair)):
        assert g["tokens"] == w["tokens"] and _close(g["logp"], w["logp"]), (g, w)
        if ref:
            assert g["ref_logp"] != g["logp"] and _close(g["ref_logp"], w["ref_logp"]), (g, w)
    assert got[1]["heldout_pairs"] == want[1]["heldout_pairs"] == 2
    assert _close(got[1]["heldout_loss"], want[1]["heldout_loss"]), (got[1], want[1])
