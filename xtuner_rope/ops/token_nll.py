"""Per-document next-token NLL of packed rows: each document scored whole and alone.

Alone, a document ``[a, e)`` predicts token ``t + 1`` from ``t`` for ``a <= t < e - 1``. fp32
log-softmax, fp64 sums; the row's target log-probs ``[s]`` (``ops.chunked_loss``) give the same.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # XTuner's and transformers' label of an unsupervised token


def document_nll(
    logits: torch.Tensor, labels: torch.Tensor, bounds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and supervised-token count of each document of one row.

    Args:
        logits: ``[s, V]`` the row's logits, or ``[s]`` fp32 log-probs of label ``t + 1`` at
            each position ``t``.
        labels: ``[s]`` labels aligned with the inputs (``-100``: not supervised).
        bounds: ``[n + 1]`` int document starts, 0 first and ``s`` (or the last real token + 1)
            last, strictly increasing.

    Returns:
        ``(nll, tokens)``: ``[n]`` float64 summed NLL and ``[n]`` int64 supervised next tokens.

    Raises:
        ValueError: shapes disagree, or ``bounds`` is not increasing within ``[0, s]``.
    """
    s = labels.shape[0]
    if logits.dim() not in (1, 2) or logits.shape[0] != s:
        raise ValueError(
            f"document_nll: logits must be [s, V] or [s] with s = {s} (the labels' length), got "
            f"{tuple(logits.shape)}; the model's predict output must keep one row per sample."
        )
    labels = labels.to(logits.device)  # the batch stays on the CPU, the logits may not
    bounds = bounds.to(torch.long).cpu()
    if bounds[0] != 0 or bounds[-1] > s or bool((bounds[1:] <= bounds[:-1]).any()):
        raise ValueError(
            f"document_nll: document boundaries must rise from 0 to at most {s}, got "
            f"{bounds.tolist()}."
        )
    # Target of position t is label t + 1, unless t + 1 starts the next document (or is past s).
    target = torch.full((s,), IGNORE_INDEX, dtype=torch.long, device=labels.device)
    target[:-1] = labels[1:]
    target[(bounds[1:] - 1).to(labels.device)] = IGNORE_INDEX
    supervised = target != IGNORE_INDEX
    token_nll = torch.zeros(s, dtype=torch.float64, device=logits.device)
    if logits.dim() == 1:  # the target log-probs themselves
        token_nll[supervised] = -logits[supervised].double()
    elif bool(supervised.any()):
        picked = torch.log_softmax(logits[supervised].float(), dim=-1)  # [k, V]
        nll = -picked.gather(1, target[supervised].unsqueeze(1)).squeeze(1)  # [k]
        token_nll[supervised] = nll.double()
    doc = torch.bucketize(torch.arange(s), bounds[1:], right=True)  # [s] document of each token
    inside = doc < len(bounds) - 1  # tokens after the last boundary (row padding) count for none
    n = len(bounds) - 1
    nll_sum = torch.zeros(n, dtype=torch.float64).index_add_(
        0, doc[inside], token_nll.cpu()[inside]
    )
    counts = torch.zeros(n, dtype=torch.long).index_add_(
        0, doc[inside], supervised.cpu()[inside].long()
    )
    return nll_sum, counts


__all__ = ["IGNORE_INDEX", "document_nll"]
