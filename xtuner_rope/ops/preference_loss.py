"""Per-pair preference losses and rewards, as XTuner 0.2's models compute them for one pair.

XTuner's ``DPO``, ``ORPO`` and ``RewardModel`` compute over a batch; a held-out set needs each
pair's loss alone (what packing must not change) and the two rewards XTuner logs. float64
throughout. Shapes: ``p`` pairs; every tensor argument is ``[p]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# DPO loss types whose loss of a pair depends on that pair only. XTuner's ``kto_pair``
# estimates its KL terms with means over the batch: it has no per-pair loss.
DPO_PAIR_LOSSES = ("sigmoid", "robust", "hinge", "ipo", "sppo_hard", "nca_pair")
REWARD_LOSSES = ("ranking", "focal")
REWARD_PENALTIES = ("log_barrier", "L2", "none")


def dpo_pair_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """XTuner's DPO loss of each pair alone, and its chosen and rejected rewards.

    Args:
        policy_chosen, policy_rejected, reference_chosen, reference_rejected: ``[p]`` log-probs of
            the responses under the policy / reference (summed over the response's supervised
            targets; averaged for ``ipo``, as XTuner does).
        loss_type: One of :data:`DPO_PAIR_LOSSES`.
        label_smoothing: The model's (``sigmoid``, ``robust``).

    Returns:
        ``(loss, chosen_reward, rejected_reward)``, each ``[p]`` float64.

    Raises:
        ValueError: a loss type without a per-pair loss, or unknown.
    """
    pc, pr, rc, rr = (
        x.double() for x in (policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    )
    logits = (pc - pr) - (rc - rr)
    chosen_reward, rejected_reward = beta * (pc - rc), beta * (pr - rr)
    if loss_type == "sigmoid":
        loss = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "robust":
        loss = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            + F.logsigmoid(-beta * logits) * label_smoothing
        ) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        loss = (logits - 1 / (2 * beta)) ** 2
    elif loss_type == "sppo_hard":
        loss = (pc - rc - 0.5 / beta) ** 2 + (pr - rr + 0.5 / beta) ** 2
    elif loss_type == "nca_pair":
        loss = (
            -F.logsigmoid(chosen_reward)
            - 0.5 * F.logsigmoid(-chosen_reward)
            - 0.5 * F.logsigmoid(-rejected_reward)
        )
    else:
        raise ValueError(
            f"DPO loss_type {loss_type!r} has no loss per pair (kto_pair estimates its KL "
            f"terms over the whole batch); expected one of {', '.join(DPO_PAIR_LOSSES)}."
        )
    return loss, chosen_reward, rejected_reward


def orpo_pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """XTuner's ORPO loss of each pair alone (the chosen mean NLL minus ``beta * logsigmoid(log odds
    ratio)``, 0 for a NaN ratio as XTuner does) from ``chosen``, ``rejected`` ``[p]`` average
    log-probs of each response, and its rewards: ``(loss, chosen_reward, rejected_reward)``, each
    ``[p]`` float64.
    """
    chosen, rejected = chosen.double(), rejected.double()
    log_odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
    ratio = F.logsigmoid(log_odds)
    odds_term = torch.where(ratio.isnan(), torch.zeros_like(ratio), beta * ratio)
    return -chosen - odds_term, beta * chosen, beta * rejected


def reward_pair_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    loss_type: str = "ranking",
    penalty_type: str = "log_barrier",
    penalty_weight: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """XTuner's reward-model loss of each pair alone (one process), and the two scores.

    Args:
        chosen, rejected: ``[p]`` the reward score of each chosen / rejected response.
        loss_type: ``ranking`` or ``focal``.
        penalty_type: ``log_barrier`` (scores kept in (-5, 5)), ``L2`` or ``none``.

    Returns:
        ``(loss, chosen, rejected)``, each ``[p]`` float64.

    Raises:
        ValueError: an unknown loss or penalty type.
    """
    chosen, rejected = chosen.double(), rejected.double()
    if loss_type not in REWARD_LOSSES or penalty_type not in REWARD_PENALTIES:
        raise ValueError(
            f"reward model loss_type {loss_type!r} / penalty_type {penalty_type!r}: expected "
            f"one of {REWARD_LOSSES} and one of {REWARD_PENALTIES} (XTuner 0.2's)."
        )
    loss = -F.logsigmoid(chosen - rejected)
    if loss_type == "focal":
        p = 2 * torch.relu(torch.sigmoid(chosen - rejected) - 0.5)
        loss = (1 - p) ** 2 * loss
    scores = torch.stack([chosen, rejected])  # [2, p]
    if penalty_type == "log_barrier":
        clamped = scores.clamp(-5 + 1e-3, 5 - 1e-3)
        penalty = (-torch.log(5 - clamped) - torch.log(clamped + 5)).sum(0)
    elif penalty_type == "L2":
        penalty = (scores**2).sum(0)
    else:
        penalty = torch.zeros_like(loss)
    return loss + penalty_weight * penalty, chosen, rejected


__all__ = [
    "DPO_PAIR_LOSSES",
    "REWARD_LOSSES",
    "REWARD_PENALTIES",
    "dpo_pair_losses",
    "orpo_pair_losses",
    "reward_pair_losses",
]
