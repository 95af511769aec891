"""``internvl_collate_fn``: XTuner's InternVL samples, several whole samples to a row.

Each row carries its samples' boundaries and their tiles in order (text-only samples' zero
tiles included, as XTuner drops them by their zero pixels).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .collate_llava import image_rows

__all__ = ["internvl_collate_fn"]


def _sample(i: int, item: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not isinstance(item, Mapping) or any(
        item.get(k) is None for k in ("input_ids", "labels", "pixel_values")
    ):
        raise TypeError(
            f"internvl_collate_fn: sample {i}: expected a dict with input_ids, labels and "
            "pixel_values (XTuner's InternVL_V1_5_Dataset item), got "
            f"{sorted(item) if isinstance(item, Mapping) else type(item).__name__}."
        )
    ids = torch.as_tensor(item["input_ids"], dtype=torch.long).reshape(-1)
    labels = torch.as_tensor(item["labels"], dtype=torch.long).reshape(-1)
    tiles = torch.as_tensor(item["pixel_values"])
    if ids.numel() == 0 or ids.shape != labels.shape or tiles.dim() != 4:
        raise ValueError(
            f"internvl_collate_fn: sample {i}: expected input_ids and labels of one length "
            f">= 1 and pixel_values [tiles, 3, H, W], got {ids.numel()} and {labels.numel()} "
            f"ids/labels and pixel_values {tuple(tiles.shape)}."
        )
    return ids, labels, tiles


def internvl_collate_fn(
    instances: Sequence[Mapping],
    pad_index: int = 0,
    *,
    max_length: int,
    pack: bool = True,
    return_hf_format: bool = False,
) -> dict:
    """Collate XTuner InternVL samples, several whole samples to a row (``pack=True``).

    Args:
        instances: ``InternVL_V1_5_Dataset`` items: ``input_ids`` / ``labels`` (1-D, image
            tokens included), ``pixel_values`` ``[tiles, 3, H, W]``.
        pad_index, pack, return_hf_format: As :func:`llava_collate_fn`.
        max_length: Row capacity in tokens (the dataset's ``max_length`` or more).

    Returns:
        ``input_ids`` / ``labels`` / ``position_ids`` / ``attention_mask`` ``[b, s]``,
        ``pixel_values`` (``b`` tensors ``[t_r, 3, H, W]``), ``cumulative_len`` (``b`` int32
        tensors ``0 .. s``), ``max_seqlen`` and ``num_unsupervised``.

    Raises:
        ValueError: ``max_length`` < 1, a sample longer than ``max_length``, an empty batch, a
            batch without any supervised label.
        TypeError: a sample that is not an XTuner InternVL item.
    """
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
        raise ValueError(
            f"internvl_collate_fn: option max_length: expected an int >= 1, got {max_length!r}."
        )
    if not instances:
        raise ValueError("internvl_collate_fn: got an empty batch (0 samples); check the sampler.")
    samples = [_sample(i, item) for i, item in enumerate(instances)]
    lengths = [ids.numel() for ids, _, _ in samples]
    tail = (
        f"(image tokens included), over max_length={max_length}. Raise max_length to the "
        "dataset's max_length."
    )
    data, plan = image_rows(
        "internvl_collate_fn", samples, lengths, max_length, pack, pad_index, tail
    )
    # Each row's samples' tiles in order, [t_r, 3, H, W] (text-only samples' zero tiles too).
    data["pixel_values"] = [torch.cat([samples[i][2] for i in row]) for row in plan]
    return data if return_hf_format else {"data": data, "data_samples": {"rows": plan}}
