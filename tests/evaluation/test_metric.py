"""``TokenLossMetric`` on packed rows of the tiny InternLM2 against each dialogue alone.

The rows go through the patched model (documents isolated, boundaries on the channel as
``PackedBatchCheckHook`` publishes them); the reference runs every dialogue alone through an
unpatched copy. Also: the token weighting (never a mean of row means), the worst-dialogues
file, and the errors.
"""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from xtuner_rope.evaluation.metric import WORST_FILE, TokenLossMetric
from xtuner_rope.models import channel
from xtuner_rope.models.internlm2 import patch_internlm2_attention
from xtuner_rope.ops.packing import flat_cumulative

LENGTHS = [[7, 19, 5, 9], [23, 12, 5]]  # two rows of 40 tokens; the last segment of row 2 pads


def _rows(vocab: int):
    b, s = len(LENGTHS), sum(LENGTHS[0])
    ids = torch.randint(0, vocab, (b, s))
    labels = ids.clone()
    labels[torch.rand(b, s) < 0.3] = -100
    labels[1, 35:] = -100  # a padding segment: no supervised token, not a dialogue
    positions = torch.cat(
        [torch.cat([torch.arange(n) for n in row])[None] for row in LENGTHS]
    )  # [b, s]
    bounds = [torch.tensor([0, *torch.tensor(row).cumsum(0).tolist()]) for row in LENGTHS]
    return ids, labels, positions, bounds


def _alone(model, ids, labels, bounds):
    nll, tokens, dialogues = [], 0, 0
    for r, row in enumerate(bounds):
        for a, e in zip(row[:-1].tolist(), row[1:].tolist()):
            target = labels[r, a + 1 : e]
            if not bool((target != -100).any()):
                continue
            logits = model(input_ids=ids[r : r + 1, a:e]).logits[0]
            nll.append(float(F.cross_entropy(logits[:-1], target, reduction="sum")))
            tokens += int((target != -100).sum())
            dialogues += 1
    return math.fsum(nll) / tokens, tokens, dialogues


def test_packed_rows_give_each_dialogue_alone(tiny_model, tmp_path):
    reference = copy.deepcopy(tiny_model).eval()
    patch_internlm2_attention(tiny_model)
    tiny_model.eval()
    vocab = tiny_model.config.vocab_size
    ids, labels, positions, bounds = _rows(vocab)
    metric = TokenLossMetric(worst=3)
    metric.output_dir = str(tmp_path)
    with torch.no_grad():
        channel.publish(flat_cumulative(bounds, ids.shape[1]), max(max(r) for r in LENGTHS))
        try:
            logits = tiny_model(input_ids=ids, position_ids=positions).logits  # [b, s, V]
            metric.process(
                {"data": {"input_ids": ids, "labels": labels}}, [{"logits": row} for row in logits]
            )
        finally:
            channel.clear()
        loss, tokens, dialogues = _alone(reference, ids, labels, bounds)
    got = metric.compute_metrics(metric.results)
    assert got["heldout_tokens"] == tokens and got["heldout_dialogues"] == dialogues == 6
    assert abs(got["heldout_loss"] - loss) <= 1e-5 * loss
    assert got["heldout_ppl"] == pytest.approx(math.exp(got["heldout_loss"]))
    worst = [json.loads(x) for x in (tmp_path / WORST_FILE).read_text().splitlines()]
    assert len(worst) == 3 and worst[0]["mean_nll"] >= worst[1]["mean_nll"] >= worst[2]["mean_nll"]


def test_token_weighted_not_a_mean_of_row_means():
    metric = TokenLossMetric()
    results = [
        {"documents": [{"nll": 10.0, "tokens": 10, "first_ids": [1]}]},  # mean 1.0
        {"documents": [{"nll": 3.0, "tokens": 1, "first_ids": [2]}]},  # mean 3.0
    ]
    assert metric.compute_metrics(results)["heldout_loss"] == pytest.approx(13.0 / 11)


def test_no_supervised_token_is_refused():
    metric = TokenLossMetric()
    with pytest.raises(ValueError, match=r"held-out set \(1 rows\) has no supervised token"):
        metric.compute_metrics([{"documents": []}])


def test_a_model_without_per_row_logits_is_refused():
    metric = TokenLossMetric()
    batch = {
        "data": {
            "input_ids": torch.zeros(2, 4, dtype=torch.long),
            "labels": torch.zeros(2, 4, dtype=torch.long),
        }
    }
    with pytest.raises(
        TypeError, match=r"val_step must return one dict with 'logits' \[s, V\] per row \(2 rows\)"
    ):
        metric.process(batch, [{"loss": torch.tensor(1.0)}])
    with pytest.raises(ValueError, match=r"held-out batch has no input_ids/labels"):
        metric.process({"data": {"pixel_values": torch.zeros(1)}}, [])
