"""Batch checks of XTuner's InternVL batches: image-context tokens against image tiles.

``InternVL_V1_5`` writes ``P`` vision tokens per kept tile over the ``<IMG_CONTEXT>`` ids in
order; when the counts disagree later samples silently get another sample's picture.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["check_image_context", "image_tiles"]


def image_tiles(pixel_values: torch.Tensor) -> int:
    """Tiles XTuner keeps of ``[t, 3, H, W]`` (those whose pixels do not sum to 0)."""
    return int((pixel_values.reshape(pixel_values.shape[0], -1).sum(dim=1) != 0).sum())


def _row_tiles(pixel_values: object, rows: int) -> list[torch.Tensor] | None:
    """Each row's ``[t, 3, H, W]`` tiles, or None when the batch holds them flat."""
    if isinstance(pixel_values, (list, tuple)):
        entries = [torch.as_tensor(p) for p in pixel_values]
        entries = [p[None] if p.dim() == 3 else p for p in entries]
    elif isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == 5:
        entries = list(pixel_values)
    else:
        return None
    return entries if len(entries) == rows else None


def check_image_context(data: Mapping, context_id: int, tokens_per_tile: int) -> list[int]:
    """The ``<IMG_CONTEXT>`` (``context_id``) count of each row of ``input_ids`` ``[b, s]``, checked
    against ``tokens_per_tile`` (``P``) times its kept tiles (``pixel_values`` ``[b, t, 3, H, W]``
    or ``b`` tensors ``[t_r, 3, H, W]``).

    Raises:
        ValueError: a row's count (or the batch's, when tiles are flat) is not ``P x`` its tiles.
    """
    ids = data["input_ids"]
    counts = (ids == context_id).sum(dim=1).tolist()
    pixels = data.get("pixel_values")
    if pixels is None:
        return counts
    rows = _row_tiles(pixels, len(counts))
    if rows is None:
        tiles = [image_tiles(torch.as_tensor(pixels).reshape(-1, *pixels.shape[-3:]))]
        counts_by = [sum(counts)]
    else:
        tiles, counts_by = [image_tiles(p) for p in rows], counts
    for r, (n, t) in enumerate(zip(counts_by, tiles)):
        if n != t * tokens_per_tile:
            where = f"row {r}" if rows is not None else "the batch"
            raise ValueError(
                f"check_image_context: {where}, field 'input_ids': {n} <IMG_CONTEXT> token(s) "
                f"(id {context_id}), expected {tokens_per_tile} per image tile x {t} tile(s) "
                f"in field 'pixel_values' = {t * tokens_per_tile}. InternVL_V1_5 would "
                "write the wrong vision tokens (or none) there. A max_length that cuts an "
                "image's tokens does this: raise max_length or shorten the sample."
            )
    return counts
