"""``llava_collate_fn``: XTuner's LLaVA samples packed into rows, planned on expanded lengths.

XTuner 0.2.0 cannot pack LLaVA data. Each placeholder counts as the ``image_tokens`` patch
embeddings it becomes; each row carries its samples' boundaries (before the expansion, which
``models.llava.restart_after_expansion`` expands) and exactly the images it takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from xtuner_rope.batch.image_packing import expanded_length
from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX
from xtuner_rope.batch.items import IGNORE_INDEX
from xtuner_rope.ops.packing import lay_out_rows, plan_packs

__all__ = ["image_rows", "llava_collate_fn"]


def _sample(i: int, item: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if (
        not isinstance(item, Mapping)
        or "input_ids" not in item
        or "labels" not in item
        or item.get("pixel_values") is None
    ):
        raise TypeError(
            f"llava_collate_fn: sample {i}: expected a dict with input_ids, labels "
            f"and pixel_values (XTuner's LLaVADataset item), got "
            f"{sorted(item) if isinstance(item, Mapping) else type(item).__name__}."
        )
    ids = torch.as_tensor(item["input_ids"], dtype=torch.long).reshape(-1)
    labels = torch.as_tensor(item["labels"], dtype=torch.long).reshape(-1)
    pixels = torch.as_tensor(item["pixel_values"])
    if ids.numel() == 0 or ids.shape != labels.shape:
        raise ValueError(
            f"llava_collate_fn: sample {i}: expected input_ids and labels of one "
            f"length >= 1, got {ids.numel()} and {labels.numel()}."
        )
    if int((ids == IMAGE_TOKEN_INDEX).sum()) > 1 or pixels.dim() != 3:
        raise ValueError(
            f"llava_collate_fn: sample {i}, field 'input_ids': expected at most one "
            f"image placeholder ({IMAGE_TOKEN_INDEX}) and one [3, H, W] "
            f"pixel_values, got {int((ids == IMAGE_TOKEN_INDEX).sum())} placeholders "
            f"and pixel_values {tuple(pixels.shape)}. XTuner's LLaVADataset gives "
            "one image per sample: use one <image> per sample at most."
        )
    return ids, labels, pixels


def image_rows(
    who: str, samples: list, lengths: list, max_length: int, pack: bool, pad_index: int, tail: str
) -> tuple[dict, list[list[int]]]:
    """``(input_ids, labels, pixels)`` samples laid into rows planned on ``lengths``: the batch
    (``lay_out_rows``, with ``num_unsupervised``) and the plan, which goes out as
    ``data_samples['rows']`` for a metric to count each sample once.

    Raises:
        ValueError: no sample is supervised; one is over ``max_length`` (``tail`` ends the message).
    """
    unsupervised = sum(not bool((lab[1:] != IGNORE_INDEX).any()) for _, lab, _ in samples)
    if unsupervised == len(samples):
        raise ValueError(
            f"{who}: all {len(samples)} samples of the batch have no supervised label (every "
            "label after the first token is -100): the mean loss would be 0/0 = NaN. Check the "
            "dataset's label masking and filter such samples (replies truncated away) out."
        )
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"{who}: sample {i}: {n} tokens {tail}")
    plan = plan_packs(lengths, max_length) if pack else [[i] for i in range(len(samples))]
    data = lay_out_rows([(ids, lab) for ids, lab, _ in samples], plan, pad_index, IGNORE_INDEX)
    data["num_unsupervised"] = unsupervised
    return data, plan


def llava_collate_fn(
    instances: Sequence[Mapping],
    pad_index: int = 0,
    *,
    max_length: int,
    image_tokens: int,
    pack: bool = True,
    return_hf_format: bool = False,
) -> dict:
    """Collate XTuner LLaVA samples, several to a row (``pack=True``) or one to a row.

    Args:
        instances: ``LLaVADataset`` items: ``input_ids`` / ``labels`` (1-D, placeholder
            ``-200``), ``pixel_values`` ``[3, H, W]`` (zeros for a text-only sample).
        pad_index: Token id of the padding.
        max_length: Row capacity in tokens *after* the image expansion.
        image_tokens: ``P``, the patch embeddings one image becomes.
        pack: Pack samples into rows (``ops.packing.plan_packs`` on expanded lengths); False:
            one sample per row.
        return_hf_format: Return the inner dict instead of ``{'data': ..., 'data_samples':
            {'rows': plan}}`` (``plan``: per row, the batch indices of its samples in order).

    Returns:
        ``input_ids`` / ``labels`` / ``position_ids`` / ``attention_mask`` ``[b, s]`` (before
        the expansion), ``pixel_values`` ``[n_images, 3, H, W]`` (one for a row without a
        placeholder), ``cumulative_len`` (``b`` int32 ``0 .. s``), ``max_seqlen`` and
        ``num_unsupervised``.

    Raises:
        ValueError: an option out of range, a sample longer than ``max_length`` once expanded,
            a sample with more than one placeholder, a batch without any supervised label.
        TypeError: a sample that is not an XTuner LLaVA item.
    """
    for name, value in (("max_length", max_length), ("image_tokens", image_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"llava_collate_fn: option {name}: expected an int >= 1, got "
                f"{value!r}. image_tokens is (image_size // patch_size) ** 2 of the "
                "vision tower (576 for CLIP-L/14 at 336 px)."
            )
    if not instances:
        raise ValueError("llava_collate_fn: got an empty batch (0 samples); check the sampler.")
    samples = [_sample(i, item) for i, item in enumerate(instances)]
    lengths = [expanded_length(ids, image_tokens) for ids, _, _ in samples]
    tail = (
        f"after its image placeholder became {image_tokens} patch embeddings, over "
        f"max_length={max_length}. Raise max_length or truncate the dataset's dialogues "
        "(LLaVADataset max_length counts the image as one token)."
    )
    data, plan = image_rows("llava_collate_fn", samples, lengths, max_length, pack, pad_index, tail)
    pixel_values = []
    for row in plan:
        images = [samples[i][2] for i in row if bool((samples[i][0] == IMAGE_TOKEN_INDEX).any())]
        pixel_values += images or [samples[row[0]][2]]  # XTuner takes one image per plain row
    data["pixel_values"] = torch.stack(pixel_values)
    return data if return_hf_format else {"data": data, "data_samples": {"rows": plan}}
