"""Target token id 0 counts in XTuner's DPO and ORPO log-probs (compat patch).

xtuner 0.2.0 builds the log-prob mask as ``labels[labels == -100] = 0; loss_mask = labels !=
0``: a supervised target with id 0 ("!" in Llama 3 and Qwen2 vocabularies) is dropped, while
the ORPO/IPO denominators still count it. Here the responses contain id 0 (an ordinary
embedding row of the tiny model) and XTuner's chosen/rejected log-probs of policy and reference
must equal an independent float64 sum of log p over each response; XTuner's own functions
(the unpatched originals) must not.
"""

from __future__ import annotations

import copy

import preference_configs as pc
import pytest
import torch
from mmengine.config import ConfigDict
from xtuner.model.dpo import DPO
from xtuner.model.orpo import ORPO

from xtuner_rope import compat
from xtuner_rope.capture.preference_losses import response_logp

PROMPT, RESPONSE = 6, 10


@pytest.fixture(scope="module")
def llm_cfg() -> ConfigDict:
    return pc.tiny_llm_cfg()


def _batch(rows: int = 4) -> dict:
    """Rows chosen, rejected, chosen, rejected; every response holds target id 0 twice or more."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 1000, (rows, PROMPT + RESPONSE), generator=gen)
    ids[:, PROMPT + 1 :: 4] = 0  # a real token inside each response
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids).bool(),
        "position_ids": torch.arange(ids.shape[1]).repeat(rows, 1),
    }


def _logps(model, names: tuple[str, ...]) -> dict:
    """XTuner's per-response values of one training forward (``get_logps`` recorded)."""
    seen = {}
    original = model.get_logps

    def record(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.update(zip(names, (o.detach().double() for o in out)))
        return out

    model.get_logps = record
    try:
        model.compute_loss(_batch())
    finally:
        del model.get_logps
    return seen


def _expected(model, average: bool) -> list[float]:
    batch = _batch()
    with torch.no_grad():
        logits = model.llm(input_ids=batch["input_ids"]).logits
    return [
        response_logp(logits[r], batch["labels"][r], average=average) for r in range(len(logits))
    ]


@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_target_id_zero_counts(llm_cfg, kind, monkeypatch):
    assert "patch_xtuner_preference_target_zero" in compat.apply()
    if kind == "dpo":
        model, names, average = (
            DPO(
                llm=copy.deepcopy(llm_cfg),
                use_varlen_attn=False,
                use_activation_checkpointing=False,
            ),
            ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected"),
            False,
        )
    else:
        model, names, average = (
            ORPO(
                llm=copy.deepcopy(llm_cfg),
                use_varlen_attn=False,
                use_activation_checkpointing=False,
            ),
            ("chosen", "rejected"),
            True,
        )
    expected = torch.tensor(_expected(model, average), dtype=torch.float64)
    got = _logps(model, names)
    for name in names:
        want = expected[::2] if name.endswith("chosen") else expected[1::2]
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-5)

    # Negative control: XTuner's own mask drops the id-0 targets (log p < 0 each).
    cls = type(model)
    monkeypatch.setattr(cls, "compute_loss", cls.compute_loss.__wrapped__)
    monkeypatch.setattr(cls, "_gather_masked_logits", cls._gather_masked_logits.__wrapped__)
    dropped = _logps(model, names)
    assert (dropped[names[0]] - expected[::2]).abs().min() > 1e-2, (dropped, expected)
