"""``PreferenceMetric`` on XTuner's real DPO, ORPO and RewardModel against each pair alone.

The models are XTuner's classes around the tiny InternLM2 checkpoint (policy weights moved
off the reference, the reward head off zero). Held-out pairs are collated by XTuner's
``preference_collate_fn``, packed (one row, boundaries on the channel as
``PackedBatchCheckHook`` publishes them, isolated attention) and unpacked (a response a row),
and go through the model's real ``val_step``. The reference runs every response alone
through unpatched copies and computes each pair's loss, its rewards, the accuracy and the
margin in float64, written out here from XTuner's formulas.
"""

from __future__ import annotations

import copy
import math

import preference_configs as pc
import pytest
import torch
import torch.nn.functional as F
from mmengine.config import ConfigDict
from xtuner.dataset.collate_fns.preference_collate_fn import preference_collate_fn
from xtuner.model.dpo import DPO
from xtuner.model.orpo import ORPO
from xtuner.model.reward import RewardModel

from xtuner_rope.evaluation.preference_metric import PreferenceMetric
from xtuner_rope.models import channel
from xtuner_rope.models.internlm2 import patch_internlm2_attention

BETA = 0.1
RTOL = 1e-5  # fp32 forward, float64 sums: ~1e-7 apart in practice
LENGTHS = [(5, 9, 4), (8, 3, 11), (4, 12, 12)]  # (prompt, chosen answer, rejected answer)
REWARD_TOKEN = 7


@pytest.fixture(scope="module")
def llm_cfg() -> ConfigDict:
    return pc.tiny_llm_cfg()


def _pairs(reward: bool) -> list[dict]:
    """Tokenized pairs as XTuner's ``PreferenceDataset`` gives them."""
    gen = torch.Generator().manual_seed(1)
    pairs = []
    for prompt, chosen, rejected in LENGTHS:
        ids = {
            side: torch.randint(6, 1000, (prompt + n,), generator=gen).tolist()
            for side, n in (("chosen", chosen), ("rejected", rejected))
        }
        ids["rejected"][:prompt] = ids["chosen"][:prompt]  # the shared prompt
        pair = {}
        for i, side in enumerate(("chosen", "rejected")):
            if reward:  # XTuner's reward rows: the reward token last, labelled 0 or 1
                pair[f"{side}_ids"] = ids[side] + [REWARD_TOKEN]
                pair[f"{side}_labels"] = [-100] * len(ids[side]) + [i]
            else:
                pair[f"{side}_ids"] = ids[side]
                pair[f"{side}_labels"] = [-100] * prompt + ids[side][prompt:]
        pairs.append(pair)
    return pairs


def _packed_item(pairs: list[dict]) -> dict:
    """One ``PackedDatasetWrapper`` row: chosen then rejected, positions restart per response."""
    item = {"input_ids": [], "labels": [], "position_ids": [], "cumulative_len": [0]}
    for pair in pairs:
        for side in ("chosen", "rejected"):
            item["input_ids"] += pair[f"{side}_ids"]
            item["labels"] += pair[f"{side}_labels"]
            item["position_ids"] += list(range(len(pair[f"{side}_ids"])))
            item["cumulative_len"].append(item["cumulative_len"][-1] + len(pair[f"{side}_ids"]))
    return item


def _build(kind: str, llm_cfg: ConfigDict, **settings):
    torch.manual_seed(0)
    if kind == "reward":
        model = RewardModel(
            llm=copy.deepcopy(llm_cfg), use_varlen_attn=True, use_activation_checkpointing=False
        )
        torch.nn.init.normal_(model.v_head.weight, std=0.5)  # zero-initialised by XTuner
    else:
        cls = DPO if kind == "dpo" else ORPO
        model = cls(
            llm=copy.deepcopy(llm_cfg),
            use_varlen_attn=True,
            use_activation_checkpointing=False,
            beta=BETA,
            **settings,
        )
        with torch.no_grad():  # a trained policy: no longer the reference
            for p in model.llm.parameters():
                p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def _alone(model, kind: str, pairs: list[dict]) -> dict:
    """Per pair, through unpatched copies, each response alone: float64 log-probs or scores."""
    out = {"policy": [], "reference": [], "tokens": [], "score": []}
    with torch.no_grad():
        for pair in pairs:
            for side in ("chosen", "rejected"):
                ids = torch.tensor([pair[f"{side}_ids"]])
                labels = torch.tensor(pair[f"{side}_labels"])
                if kind == "reward":
                    hidden = model.llm(input_ids=ids)[0][0]  # [s, h]
                    out["score"].append(float(model.v_head(hidden)[labels != -100, 0].double()))
                    continue
                target = labels[1:]
                out["tokens"].append(int((target != -100).sum()))
                for name, llm in (
                    ("policy", model.llm),
                    ("reference", getattr(model, "ref_llm", None)),
                ):
                    if llm is None:
                        continue
                    logits = llm(input_ids=ids).logits[0, :-1].double()
                    nll = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
                    out[name].append(-float(nll))
    return out


def _plain_metrics(kind: str, alone: dict, loss_type: str = "sigmoid") -> dict:
    """XTuner's per-pair losses and rewards, written out, averaged over pairs."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in alone.items() if v}
    if kind == "reward":
        c, r = t["score"][::2], t["score"][1::2]
        scores = torch.stack([c, r]).clamp(-5 + 1e-3, 5 - 1e-3)
        barrier = (-torch.log(5 - scores) - torch.log(scores + 5)).sum(0)
        loss, cr, rr = -F.logsigmoid(c - r) + 0.01 * barrier, c, r
    elif kind == "orpo":
        avg = t["policy"] / t["tokens"]
        c, r = avg[::2], avg[1::2]
        log_odds = (c - r) - (torch.log1p(-c.exp()) - torch.log1p(-r.exp()))
        loss, cr, rr = -c - BETA * F.logsigmoid(log_odds), BETA * c, BETA * r
    else:
        pol, ref = t["policy"], t["reference"]
        if loss_type == "ipo":
            pol, ref = pol / t["tokens"], ref / t["tokens"]
        cr, rr = BETA * (pol[::2] - ref[::2]), BETA * (pol[1::2] - ref[1::2])
        logits = (cr - rr) / BETA
        loss = -F.logsigmoid(BETA * logits) if loss_type == "sigmoid" else (logits - 5.0) ** 2
    return {
        "heldout_loss": float(loss.mean()),
        "heldout_accuracy": float((cr > rr).double().mean()),
        "heldout_margin": float((cr - rr).mean()),
        "heldout_pairs": len(cr),
    }


def _metric_of(model, batch: dict, packed: bool) -> dict:
    """The metric over one held-out batch, through the model's real ``val_step``."""
    metric = PreferenceMetric()
    metric.bind(model)
    data = batch["data"]
    if packed:  # as PackedBatchCheckHook does: boundaries off the batch, onto the channel
        (cumulative,) = data.pop("cumulative_len")
        data.pop("max_seqlen")
        channel.publish(cumulative, int((cumulative[1:] - cumulative[:-1]).max()))
    try:
        with torch.no_grad():
            outputs = model.val_step(batch)
        metric.process(batch, outputs)
    finally:
        channel.clear()
    return metric.compute_metrics(metric.results)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize(
    "kind,loss_type", [("dpo", "sigmoid"), ("dpo", "ipo"), ("orpo", None), ("reward", None)]
)
def test_metric_equals_each_pair_alone(llm_cfg, kind, loss_type, packed):
    settings = {"loss_type": loss_type} if loss_type else {}
    model = _build(kind, llm_cfg, **settings)
    pairs = _pairs(reward=kind == "reward")
    want = _plain_metrics(kind, _alone(model, kind, pairs), loss_type)
    for part in (model.llm, getattr(model, "ref_llm", None)):
        if part is not None:
            patch_internlm2_attention(part)
    batch = (
        preference_collate_fn([_packed_item(pairs)], use_varlen_attn=True)
        if packed
        else preference_collate_fn(pairs, use_varlen_attn=False)
    )
    got = _metric_of(model, batch, packed)
    assert got["heldout_pairs"] == want["heldout_pairs"] == len(LENGTHS)
    assert got["heldout_accuracy"] == want["heldout_accuracy"]
    for key in ("heldout_loss", "heldout_margin"):
        assert math.isclose(got[key], want[key], rel_tol=RTOL, abs_tol=1e-7), (key, got, want)
    if kind != "reward":  # the scores differ from pair to pair: a non-trivial check
        assert 0 < want["heldout_loss"] and want["heldout_margin"] != 0, want


def test_a_model_it_cannot_serve_is_refused(llm_cfg):
    from xtuner.model import SupervisedFinetune

    model = SupervisedFinetune(llm=copy.deepcopy(llm_cfg), use_activation_checkpointing=False)
    with pytest.raises(TypeError, match=r"serves XTuner's DPO, ORPO and RewardModel; this run's"):
        PreferenceMetric().bind(model)


def test_kto_pair_has_no_per_pair_loss(llm_cfg):
    model = DPO(
        llm=copy.deepcopy(llm_cfg), loss_type="kto_pair", use_activation_checkpointing=False
    )
    with pytest.raises(ValueError, match=r"loss_type='kto_pair' has no loss per pair"):
        PreferenceMetric().bind(model)


def test_unbound_metric_and_wrong_outputs_are_refused(llm_cfg):
    batch = {"data": {"labels": torch.zeros(2, 4, dtype=torch.long)}}
    with pytest.raises(RuntimeError, match=r"not bound to the run's model; HeldOutCurvesHook"):
        PreferenceMetric().process(batch, [])
    metric = PreferenceMetric()
    metric.kind, metric.settings = "dpo", {"beta": 0.1}
    with pytest.raises(TypeError, match=r"\(dpo\): model.val_step must return one dict with "):
        metric.process(batch, [{"logits": torch.zeros(4, 8)}] * 2)  # no ref_logits
    with pytest.raises(ValueError, match=r"a held-out batch of 1 row\(s\) without response bound"):
        metric.process({"data": {"labels": torch.zeros(1, 4, dtype=torch.long)}}, [{}])
    with pytest.raises(ValueError, match=r"a held-out batch of 1 row\(s\) without response bound"):
        metric.process({"data": {"labels": torch.zeros(1, 4, dtype=torch.long)}}, [{}])
    with pytest.raises(ValueError, match=r"a held-out batch of 1 row\(s\) without response bound"):
        metric.process({"data": {"labels": torch.zeros(1, 4, dtype=torch.long)}}, [{}])
    with pytest.raises(ValueError, match=r"held-out set \(0 rows\) has no pair"):
        metric.compute_metrics([])
