"""Batch checks of XTuner's LLaVA batches: image placeholders (``-200``) against images.

``LLaVAModel`` takes the images in order, one per placeholder and one per row without any: a
mismatch gives later samples the wrong picture or an ``IndexError`` deep in the model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .checks import check_packed_batch

IMAGE_TOKEN_INDEX = -200  # xtuner.utils.IMAGE_TOKEN_INDEX (0.2.0)

__all__ = [
    "IMAGE_TOKEN_INDEX",
    "check_batch_with_images",
    "check_image_placeholders",
    "image_count",
]


def image_count(pixel_values: object) -> int:
    """Images in a batch's ``pixel_values``: ``[n, 3, H, W]`` (or a list of ``[3, H, W]``)."""
    if isinstance(pixel_values, torch.Tensor):
        return pixel_values.shape[0] if pixel_values.dim() == 4 else 1
    if isinstance(pixel_values, (list, tuple)):
        return len(pixel_values)
    raise TypeError(
        f"check_image_placeholders: field 'pixel_values': expected a [n, 3, H, W] "
        f"tensor or a list of images, got {type(pixel_values).__name__}. Collate "
        "LLaVA samples with XTuner's default_collate_fn."
    )


def check_image_placeholders(data: Mapping) -> list[int]:
    """Each row's placeholder count of ``input_ids`` ``[b, s]``, checked against ``pixel_values``.

    Raises:
        ValueError: a row needs more images than are left, or images are left over.
    """
    ids = data["input_ids"]
    counts = (ids == IMAGE_TOKEN_INDEX).sum(dim=1).tolist()
    images = image_count(data["pixel_values"])
    used = 0
    for row, count in enumerate(counts):
        need = max(1, count)  # a text-only row takes (and ignores) one image, as XTuner does
        if used + need > images:
            raise ValueError(
                f"check_image_placeholders: row {row} (sample {row}), field 'input_ids': "
                f"{count} image placeholder(s) ({IMAGE_TOKEN_INDEX}), but field 'pixel_values' "
                f"has {images} image(s) for {len(counts)} row(s) and {images - used} left for "
                "this one. XTuner's LLaVADataset gives each sample one image (a zero image "
                "without <image>): use one <image> per sample at most, or bring its images."
            )
        used += need
    if used != images:
        raise ValueError(
            f"check_image_placeholders: field 'pixel_values': {images} image(s), but the "
            f"{len(counts)} row(s) take {used} (one per placeholder {IMAGE_TOKEN_INDEX}, one "
            f"per row without any; placeholders per row {counts}): later samples would get "
            "another sample's picture. Collate images and input_ids from the same samples."
        )
    return counts


def check_batch_with_images(
    data: Mapping, *, vocab_size: int | None = None, max_position: int | None = None
) -> None:
    """:func:`check_packed_batch`, each image placeholder read as a valid id when images came."""
    if data.get("pixel_values") is None or not isinstance(data.get("input_ids"), torch.Tensor):
        check_packed_batch(data, vocab_size=vocab_size, max_position=max_position)
        return
    check_image_placeholders(data)
    ids = data["input_ids"]
    check_packed_batch(
        {**data, "input_ids": ids.masked_fill(ids == IMAGE_TOKEN_INDEX, 0)},
        vocab_size=vocab_size,
        max_position=None,
    )
