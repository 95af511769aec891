"""Per-micro-batch counts the token-weighted step needs: supervised tokens, dialogue weights."""

from __future__ import annotations

import torch

from xtuner_rope.ops.token_nll import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "dialogue_weights", "supervised_tokens"]


def supervised_tokens(labels: torch.Tensor) -> int:
    """Labels other than -100 of ``[b, s]`` ``labels`` after the causal shift (the mean's
    divisor)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def dialogue_weights(labels: torch.Tensor, boundaries=None) -> tuple[torch.Tensor, int]:
    """Per-token loss weights of the per-dialogue mean, and the dialogues that carry a loss.

    Args:
        labels: ``[b, s]`` XTuner labels.
        boundaries: ``b`` 1-D ``cumulative_len`` tensors, or None: every row is one dialogue.

    Returns:
        ``[b, s - 1]`` float32 weights aligned with ``labels[:, 1:]`` (``1 / n_d`` on each
        supervised label of dialogue ``d``), and the number of dialogues with one.
    """
    b, s = labels.shape
    segment = torch.arange(b).unsqueeze(1).expand(b, s).clone()  # unpacked: a row, a dialogue
    if boundaries is not None:
        first = 0
        for row, bounds in enumerate(boundaries):
            bounds = torch.as_tensor(bounds, dtype=torch.long).reshape(-1)
            ids = torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds.diff())[:s]
            segment[row] = first + len(bounds) - 1  # positions after the last boundary
            segment[row, : len(ids)] = first + ids
            first += len(bounds)
    segment, supervised = segment[:, 1:], labels[:, 1:] != IGNORE_INDEX
    counts = torch.bincount(segment[supervised], minlength=int(segment.max()) + 1)
    weights = torch.zeros(b, s - 1, dtype=torch.float32)
    weights[supervised] = 1.0 / counts[segment[supervised]].float()
    return weights, int((counts > 0).sum())
