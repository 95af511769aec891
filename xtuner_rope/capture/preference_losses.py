"""The references of the preference capture, float64: each response's log-prob and XTuner's
losses rebuilt from them (through ``ops.preference_loss``, as the metrics).
"""

from __future__ import annotations

import torch

from xtuner_rope.ops.preference_loss import dpo_pair_losses, reward_pair_losses

__all__ = ["dpo_sigmoid_loss", "orpo_loss", "response_logp", "reward_loss"]

IGNORE = -100


def response_logp(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> float:
    """Sum (or with ``average`` the mean) of log p(target) over a response's supervised targets,
    float64, from its own ``[s, V]`` ``logits`` and ``[s]`` unshifted ``labels``."""
    logp = logits[:-1].double().log_softmax(-1)  # [s - 1, V]: token t predicts t + 1
    targets = labels[1:]
    supervised = targets != IGNORE
    picked = logp[supervised].gather(1, targets[supervised].unsqueeze(1)).sum()
    return float(picked / supervised.sum()) if average else float(picked)


def dpo_sigmoid_loss(values: dict, beta: float, label_smoothing: float = 0.0) -> float:
    """XTuner's DPO ``sigmoid`` loss (mean over pairs) from per-response log-probs, float64."""
    names = ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")
    loss, _, _ = dpo_pair_losses(
        *(torch.tensor(values[name], dtype=torch.float64) for name in names),
        beta,
        "sigmoid",
        label_smoothing,
    )
    return float(loss.mean())


def orpo_loss(values: dict, counts: list[int], beta: float) -> float:
    """XTuner's ORPO loss from per-response average log-probs (``{'chosen', 'rejected'}``), float64:
    the chosen NLL over their ``counts`` supervised targets minus the mean of ``beta *
    logsigmoid(log odds ratio)`` (NaN ratios skipped, as XTuner)."""
    chosen = torch.tensor(values["chosen"], dtype=torch.float64)
    rejected = torch.tensor(values["rejected"], dtype=torch.float64)
    n = torch.tensor(counts, dtype=torch.float64)
    nll = -(chosen * n).sum() / n.sum()
    log_odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
    ratio = torch.nn.functional.logsigmoid(log_odds)
    return float(nll - (beta * ratio[~ratio.isnan()]).mean())


def reward_loss(
    values: dict,
    loss_type: str = "ranking",
    penalty_type: str = "log_barrier",
    penalty_weight: float = 0.01,
) -> float | None:
    """XTuner's reward-model loss of one process's batch from its scores, float64: the (focal)
    ranking loss plus ``penalty_weight`` times the penalty, over pairs (XTuner's equals it on one
    process only); None for a type XTuner does not have."""
    chosen = torch.tensor(values["chosen"], dtype=torch.float64)
    rejected = torch.tensor(values["rejected"], dtype=torch.float64)
    try:  # each pair's ranking loss plus its two scores' penalty: their mean is the batch's
        loss, _, _ = reward_pair_losses(chosen, rejected, loss_type, penalty_type, penalty_weight)
    except ValueError:
        return None
    return float(loss.mean())
