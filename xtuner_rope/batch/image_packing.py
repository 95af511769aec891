"""Lengths and boundaries of LLaVA samples as the LLM sees them, after the image expansion.

Each placeholder becomes the image's ``P`` patch embeddings: a sample of ``n`` ids with ``k``
placeholders is ``n - k + k * P`` tokens long; plans and boundaries use those lengths.
"""

from __future__ import annotations

import torch

from .images import IMAGE_TOKEN_INDEX

__all__ = ["expand_row_boundaries", "expanded_length", "llava_samples"]


def expanded_length(ids: torch.Tensor, image_tokens: int) -> int:
    """Tokens the LLM sees for one sample's ``[n]`` ids: ``n - k + k * image_tokens`` (``k``
    placeholders ``IMAGE_TOKEN_INDEX``, each ``image_tokens`` patch embeddings)."""
    k = int((ids == IMAGE_TOKEN_INDEX).sum())
    return int(ids.numel()) + k * (image_tokens - 1)


def expand_row_boundaries(
    ids: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor, image_tokens: int
) -> list[int]:
    """The expanded lengths of a collated row's real segments, in row order.

    Args:
        ids: ``[s]`` the row's ids before the expansion; mask: ``[s]`` bool, True on real tokens.
        cu: ``[n + 1]`` the row's boundaries before the expansion, ``0 .. s``.
        image_tokens: ``P``, patch embeddings per image.

    Raises:
        ValueError: a segment mixes real tokens and padding (the expansion would merge it).
    """
    lengths = []
    cu = [int(c) for c in cu]
    for start, end in zip(cu[:-1], cu[1:]):
        real = int(mask[start:end].sum())
        if real == 0:
            continue
        if real != end - start:
            raise ValueError(
                f"expand_row_boundaries: segment [{start}, {end}) has {real} real "
                f"tokens of {end - start}: expected a sample or padding, not both. "
                "Collate LLaVA samples with xtuner_rope.llava_collate_fn."
            )
        lengths.append(expanded_length(ids[start:end], image_tokens))
    return lengths


def _row_segments(data: dict) -> list[list[int]]:
    """Each row's boundaries before the expansion: ``cumulative_len`` or one sample per row."""
    b, s = data["input_ids"].shape
    if data.get("cumulative_len") is not None:
        return [[int(c) for c in cu] for cu in data["cumulative_len"]]
    mask = data.get("attention_mask")
    lengths = [int(m.sum()) for m in mask] if mask is not None else [s] * b
    return [[0, n] if n == s else [0, n, s] for n in lengths]


def llava_samples(data: dict, image_tokens: int) -> list[dict]:
    """The samples of a collated LLaVA batch (``data``), where the LLM sees them and what they hold.

    Returns:
        Per sample: ``row``, ``raw`` and ``expanded`` ``(start, end)``, ``image`` (index into
        ``pixel_values``; a text-only sample's row's ignored image or the first) and ``has_image``.
    """
    ids = data["input_ids"]
    mask = data.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    samples, image = [], 0
    for r, cu in enumerate(_row_segments(data)):
        row_image, col = image, 0
        lengths = iter(expand_row_boundaries(ids[r], mask[r], torch.tensor(cu), image_tokens))
        placeholders = 0
        for a, e in zip(cu[:-1], cu[1:]):
            if not bool(mask[r, a:e].any()):
                continue
            n = next(lengths)
            has = bool((ids[r, a:e] == IMAGE_TOKEN_INDEX).any())
            samples.append(
                {
                    "row": r,
                    "raw": (a, e),
                    "expanded": (col, col + n),
                    "image": image if has else row_image,
                    "has_image": has,
                }
            )
            image += int((ids[r, a:e] == IMAGE_TOKEN_INDEX).sum())
            placeholders += has
            col += n
        image += 0 if placeholders else 1  # XTuner's expansion takes one image per plain row
    return samples
