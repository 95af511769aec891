"""The doctor's figure for the loss weighting: how unequal tokens would weigh without the fix.

XTuner's per-micro-batch mean divided by the accumulation ``a`` weighs a token ``1 / (a * n_m)``,
the token-weighted loss ``1 / N``: the factor per dialogue is ``N / (a * n_m)``.
"""

from __future__ import annotations

from collections.abc import Sequence

# A dialogue whose weight XTuner's weighting multiplies or divides by more than this counts.
CHANGE = 2.0


def token_weight_figures(
    batches: Sequence[Sequence[int]], dialogues: Sequence[int], accumulation: int
) -> dict:
    """Per-token weight inequality of XTuner's per-micro-batch loss, against token weighting.

    Args:
        batches: ``[m]`` micro-batches in sampler order: each item's supervised tokens.
        dialogues: ``[m]`` dialogues in each micro-batch.
        accumulation: ``optim_wrapper.accumulative_counts`` (the last window may be shorter).

    Returns:
        ``max_over_min`` (None without a supervised micro-batch), ``changed_2x_share``
        (dialogues reweighted > 2x), ``micro_batches``, ``windows``, ``accumulation``.
    """
    factors, weights = [], []  # per supervised micro-batch: N / (a * n_m), its dialogues
    windows = 0
    for start in range(0, len(batches), accumulation):
        counts = [sum(batch) for batch in batches[start : start + accumulation]]
        windows += 1
        total = sum(counts)
        for offset, n in enumerate(counts):
            if n > 0:
                factors.append(total / (len(counts) * n))
                weights.append(dialogues[start + offset])
    changed = sum(w for f, w in zip(factors, weights) if f > CHANGE or f < 1 / CHANGE)
    return {
        "accumulation": accumulation,
        "micro_batches": len(batches),
        "windows": windows,
        "max_over_min": max(factors) / min(factors) if factors else None,
        "changed_2x_share": changed / sum(weights) if weights else None,
    }


def dataset_loss_weights(
    dataset: Sequence,
    supervised: Sequence[int],
    batch_size: int,
    accumulation: int,
    max_batches: int,
) -> dict:
    """:func:`token_weight_figures` of the first ``max_batches`` micro-batches of ``batch_size``
    items of ``dataset`` (dataset order; ``supervised``: ``[n]`` tokens per item)."""
    batches, dialogues = [], []
    for start in range(0, min(len(dataset), max_batches * batch_size), batch_size):
        indices = range(start, min(start + batch_size, len(dataset)))
        batches.append([supervised[i] for i in indices])
        dialogues.append(sum(_dialogues(dataset[i]) for i in indices))
    return token_weight_figures(batches, dialogues, max(int(accumulation), 1))


def _dialogues(item: dict) -> int:
    """Dialogues in one dataset item: a packed row's ``cumulative_len`` has ``k + 1`` bounds."""
    bounds = item.get("cumulative_len") if hasattr(item, "get") else None
    return max(len(bounds) - 1, 1) if bounds is not None and len(bounds) > 1 else 1


def loss_weight_line(figures: dict | None) -> list[str]:
    """The doctor summary's line for the figures (none when there is nothing to say)."""
    if not figures or figures["max_over_min"] is None:
        return []
    return [
        f"loss weights without the token-weighted loss: max/min per-token weight "
        f"{figures['max_over_min']:.2f}x, {figures['changed_2x_share']:.1%} of dialogues "
        f"weighted >2x differently (accumulation {figures['accumulation']}, "
        f"{figures['micro_batches']} micro-batches)"
    ]
