"""XTuner's LLaVA training data, checked before the first step (the doctor runs the same checks).

Missing or unreadable images, ``<image>`` placeholders that do not match their image, and
samples too long once each image is ``P`` tokens: found from the text and image headers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX

__all__ = ["check_llava_dataset", "llava_data_problems", "unreadable_image"]


def unreadable_image(path: str) -> str | None:
    """Why the image at ``path`` cannot be opened (PIL parses the header only), else None."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.size  # noqa: B018 - the header is parsed on open
    except (OSError, Image.DecompressionBombError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _first(indices: list, n: int = 5) -> str:
    more = ", ..." if len(indices) > n else ""
    return ", ".join(str(i) for i in indices[:n]) + more


def _image_problems(names: Sequence, folder: str) -> list[str]:
    missing, unreadable = [], []
    for i, name in enumerate(names):
        if name is None:
            continue
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            missing.append(i)
        else:
            why = unreadable_image(path)
            if why:
                unreadable.append(f"{i} ({name}: {why[:120]})")
    named = sum(n is not None for n in names)
    problems = []
    if missing:
        problems.append(
            f"train_dataloader.dataset.image_folder: {len(missing)} of {named} samples name an "
            f"image that is not there (first: {_first(missing)}): the step that loads one "
            "fails. Point image_folder at the images of data_path."
        )
    if unreadable:
        problems.append(
            f"train_dataloader.dataset: {len(unreadable)} samples name an image that cannot be "
            f"opened (first: {_first(unreadable, 3)}): the step that loads one fails. Replace "
            "the files or remove the samples from data_path."
        )
    return problems


def _placeholder_problems(ids: Sequence, names: Sequence) -> list[str]:
    counts = [sum(1 for t in row if t == IMAGE_TOKEN_INDEX) for row in ids]
    many = [i for i, k in enumerate(counts) if k > 1]
    unmatched = [
        f"{i} ({'no image' if n is None else n}, {k} <image>)"
        for i, (k, n) in enumerate(zip(counts, names))
        if k <= 1 and k != (n is not None)
    ]
    problems = []
    if many:
        problems.append(
            f"samples with more than one <image> placeholder (first: {_first(many)}): XTuner's "
            "LLaVADataset loads one image per sample, so the batch check refuses them. Keep "
            "one <image> per sample."
        )
    if unmatched:
        problems.append(
            f"train_dataloader.dataset: samples whose <image> does not match their image "
            f"(first: {_first(unmatched, 3)}): XTuner's expansion ignores an image without "
            "<image> and expands a zero (black) image for an <image> without one. Give each "
            "sample with an image one <image> in its text and none to the others; a "
            "placeholder cut by the dataset's max_length needs a larger max_length."
        )
    return problems


def _length_problems(
    ids: Sequence, image_tokens: int, row_capacity: int | None, max_position: int | None
) -> list[str]:
    lengths = [
        len(row) + sum(t == IMAGE_TOKEN_INDEX for t in row) * (image_tokens - 1) for row in ids
    ]
    problems = []
    for limit, setting, why in (
        (row_capacity, f"train_dataloader.collate_fn.max_length={row_capacity}", "a row"),
        (max_position, "max_length", f"the LLM's RoPE range ({max_position} positions)"),
    ):
        over = [i for i, n in enumerate(lengths) if limit is not None and n > limit]
        if over:
            problems.append(
                f"{setting}: {len(over)} samples are longer than {why} once each image is "
                f"{image_tokens} patch embeddings (first: "
                f"{_first([f'{i} ({lengths[i]} tokens)' for i in over], 3)}): the batch that "
                f"holds one is refused. Make every sample fit ({max(lengths)} tokens at most "
                "here): raise the collate max_length, or lower the dataset's max_length (it "
                "counts an image as one token)."
            )
    return problems


def llava_data_problems(
    ids: Sequence[Sequence[int]],
    names: Sequence[str | None],
    image_folder: str,
    image_tokens: int,
    row_capacity: int | None = None,
    max_position: int | None = None,
) -> list[str]:
    """What in a LLaVA dataset fails or trains silently wrong, each naming samples and fix.

    Args:
        ids: ``[n]`` tokenized samples; names: ``[n]`` image files (None: text-only), looked up
            in ``image_folder``.
        image_tokens: ``P``, patch embeddings per image.
        row_capacity: ``llava_collate_fn``'s ``max_length`` (None: XTuner's padding).
        max_position: The LLM's RoPE range (None: unchecked).
    """
    return (
        _image_problems(names, image_folder or "")
        + _placeholder_problems(ids, names)
        + _length_problems(ids, image_tokens, row_capacity, max_position)
    )


def check_llava_dataset(
    dataset, image_tokens: int, row_capacity: int | None = None, max_position: int | None = None
) -> None:
    """Refuse a built ``LLaVADataset`` with any of :func:`llava_data_problems`, before training.

    Raises:
        ValueError: every problem found, each naming its samples and the fix.
    """
    text = dataset.text_data
    ids = text["input_ids"]
    names = text["image"] if "image" in text.column_names else [None] * len(ids)
    problems = llava_data_problems(
        ids, names, dataset.image_folder, image_tokens, row_capacity, max_position
    )
    if problems:
        items = "\n".join(f"{i}. {p}" for i, p in enumerate(problems, 1))
        raise ValueError(
            f"xtuner-rope: the LLaVA training data would fail or train silently wrong "
            f"({len(ids)} samples, each image {image_tokens} tokens for the LLM); fix the data "
            f"or the setting and start again:\n{items}"
        )
