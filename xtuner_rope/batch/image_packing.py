"""Lengths and boundaries of LLaVA samples as the LLM sees them, after the image expansion.

XTuner's ``prepare_inputs_labels_for_multimodal`` replaces each image placeholder
(``IMAGE_TOKEN_INDEX``) by the image's ``P`` patch embeddings, so a sample of ``n`` ids with
``k`` placeholders is ``n - k + k * P`` tokens long for the LLM. Packing plans rows on those
*expanded* lengths, and the boundaries published for the attention must be expanded the same
way: :func:`expanded_length` and :func:`expand_row_boundaries` do that arithmetic.
"""

from __future__ import annotations

import torch

from .images import IMAGE_TOKEN_INDEX

__all__ = ["expand_row_boundaries", "expanded_length"]


def expanded_length(ids: torch.Tensor, image_tokens: int) -> int:
    """Tokens the LLM sees for one sample: ``n - k + k * image_tokens`` (``k`` placeholders).

    Args:
        ids: ``[n]`` token ids, ``IMAGE_TOKEN_INDEX`` where an image goes.
        image_tokens: ``P``, patch embeddings per image.
    """
    k = int((ids == IMAGE_TOKEN_INDEX).sum())
    return int(ids.numel()) + k * (image_tokens - 1)


def expand_row_boundaries(
    ids: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor, image_tokens: int
) -> list[int]:
    """A collated row's real segments, measured after the image expansion.

    Args:
        ids: ``[s]`` the row's ids before the expansion (placeholders included).
        mask: ``[s]`` bool, True on real tokens (the expansion drops the others).
        cu: ``[n + 1]`` the row's boundaries before the expansion, ``0 .. s``.
        image_tokens: ``P``, patch embeddings per image.

    Returns:
        The expanded lengths of the segments holding real tokens, in row order.

    Raises:
        ValueError: a segment mixes real tokens and padding (the expansion would merge it
            with its neighbour).
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
