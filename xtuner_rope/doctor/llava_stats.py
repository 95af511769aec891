"""The doctor on XTuner's LLaVA configs: lengths as the LLM sees them, after the image expansion.

Each ``IMAGE_TOKEN_INDEX`` placeholder becomes ``P`` patch embeddings (``P`` read from the
vision tower's config): :func:`llava_view` expands the tokenized text the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from xtuner_rope.batch.image_packing import expanded_length
from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX
from xtuner_rope.batch.items import IGNORE_INDEX
from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.doctor.stats import length_percentiles, percentiles_text

__all__ = [
    "LLaVAView",
    "expand_item",
    "image_tokens_of",
    "llava_data_of",
    "llava_figures",
    "llava_lines",
    "llava_view",
    "llava_warnings",
    "refuse_unserved_model",
    "sampler_padding",
]


def _get(node: object, key: str, default: object = None) -> object:
    return node.get(key, default) if isinstance(node, Mapping) else default


def refuse_unserved_model(path: str) -> None:
    """Stop before any data when the start-up refuses ``model.type`` (``xtuner train`` would too).

    Raises:
        ConfigConflict: the start-up's refusal of ``model.type``, with what to do.
    """
    from mmengine.config import Config

    from xtuner_rope.config import startup
    from xtuner_rope.config.findings import ConfigConflict, conflict_message

    conflicts = [
        f
        for f in startup.inspect_config(Config.fromfile(path))
        if f.setting == "model.type" and f.fix is None
    ]
    if conflicts:
        raise ConfigConflict(conflict_message(conflicts))


def image_tokens_of(cfg) -> dict:
    """``{'image_tokens': P, 'image_size', 'patch_size', 'model_type', 'path'}`` of a started LLaVA
    config's vision tower, as the start-up reads it (``config.llava_tower``).

    Raises:
        ValueError: the tower's config has no ``image_size`` / ``patch_size``.
    """
    from xtuner_rope.config.llava_tower import tower_image_tokens

    encoder = _get(_get(config_dict(cfg), "model"), "visual_encoder")
    return tower_image_tokens(_get(encoder, "pretrained_model_name_or_path"))


def expand_item(input_ids: Sequence[int], labels: Sequence[int], image_tokens: int) -> dict:
    """One sample as the LLM sees it: ``{'input_ids', 'labels'}`` of ``n - k + k * P`` tokens, each
    placeholder ``image_tokens`` (``P``) times with label -100."""
    ids, labs = [], []
    for token, label in zip(input_ids, labels):
        if token == IMAGE_TOKEN_INDEX:
            ids += [IMAGE_TOKEN_INDEX] * image_tokens
            labs += [IGNORE_INDEX] * image_tokens
        else:
            ids.append(int(token))
            labs.append(int(label))
    return {"input_ids": ids, "labels": labs}


class _ExpandedText(Sequence):
    """The dataset's tokenized samples, expanded (no image is opened)."""

    def __init__(self, text_data, image_tokens: int) -> None:
        self._ids = text_data["input_ids"]
        self._labels = text_data["labels"]
        self._p = image_tokens

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: int) -> dict:
        return expand_item(self._ids[index], self._labels[index], self._p)


class _ImageItems(Sequence):
    """The dataset's real items (images loaded); a missing image is a refusal, not a crash."""

    def __init__(self, dataset) -> None:
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> dict:
        try:
            return self._dataset[index]
        except OSError as exc:  # FileNotFoundError, PIL's UnidentifiedImageError
            raise ValueError(
                f"sample {index}: its image cannot be opened ({exc}); check "
                "train_dataloader.dataset.image_folder"
            ) from exc


def _expanded_batch(out: object, image_tokens: int) -> dict:
    """The collated batch's ``[b, s']`` after the expansion, and its rows packing several
    samples."""
    data = out.get("data", out) if isinstance(out, Mapping) else out
    ids, mask = data["input_ids"], data.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    rows = [expanded_length(row[m], image_tokens) for row, m in zip(ids, mask)]
    packed = sum(
        sum(bool(m[a:e].any()) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())) > 1
        for cu, m in zip(data.get("cumulative_len") or [], mask)
    )
    return {
        "data": {
            "input_ids": torch.zeros(len(rows), max(rows), dtype=torch.long),
            "expanded_row_lengths": rows,
        },
        "packed_rows": packed,
    }


@dataclass
class LLaVAView:
    """What the doctor scans and collates for a LLaVA config."""

    scan_items: Sequence  # expanded samples, for lengths and labels
    collate_items: Sequence  # real items, for the config's collate function
    config_collate_fn: Callable  # the config's, kwargs bound
    image_tokens: dict
    llm_max_position: int | None  # the LLM config's max_position_embeddings
    packed_rows: int = 0  # rows of several samples seen by collate_fn so far

    def collate_fn(self, items: list) -> dict:
        """The config's collate function, then the expansion's arithmetic (``[b, s']``)."""
        out = _expanded_batch(self.config_collate_fn(items), self.image_tokens["image_tokens"])
        self.packed_rows += out.pop("packed_rows")
        return out


def _llm_max_position(cfg) -> int | None:
    """The LLM's ``max_position_embeddings`` from its ``config.json`` (no remote code runs)."""
    from xtuner_rope.models.checkpoint_config import read_checkpoint_config

    llm = _get(_get(config_dict(cfg), "model"), "llm")
    config = read_checkpoint_config(_get(llm, "pretrained_model_name_or_path"))
    value = None if config is None else config.get("max_position_embeddings")
    return value if isinstance(value, int) else None


def llava_view(cfg, dataset, collate_fn: Callable) -> LLaVAView | None:
    """The doctor's view of a LLaVA config's built ``LLaVADataset`` and bound ``collate_fn``; None for
    any other config."""
    from xtuner_rope.config.multimodal import is_llava

    if not is_llava(cfg) or not hasattr(dataset, "text_data"):
        return None
    tokens = image_tokens_of(cfg)
    p = tokens["image_tokens"]
    return LLaVAView(
        _ExpandedText(dataset.text_data, p),
        _ImageItems(dataset),
        collate_fn,
        tokens,
        _llm_max_position(cfg),
    )


def _crop_size(dataset) -> tuple[int, int] | None:
    processor = getattr(dataset, "image_processor", None)
    crop = getattr(processor, "crop_size", None) or getattr(processor, "size", None)
    if isinstance(crop, Mapping) and "height" in crop and "width" in crop:
        return int(crop["height"]), int(crop["width"])
    return None


def sampler_padding(
    cfg, dataset, lengths: Sequence[int], batch_size: int, max_batches: int
) -> dict:
    """Real-token share of the first ``max_batches`` padded batches of ``batch_size`` in the order
    of the config's own sampler (built as the Runner builds it, ``randomness.seed`` or 0);
    ``lengths``: ``[n]`` expanded sample lengths of ``dataset``. Returns ``{'sampler', 'seed',
    'batches', 'padded_share'}``.
    """
    from mmengine.registry import DATA_SAMPLERS

    from xtuner_rope.config.fields import type_name

    sampler_cfg = dict(_get(cfg.train_dataloader, "sampler") or {})
    seed = _get(cfg.get("randomness"), "seed")
    seed = 0 if seed is None else int(seed)
    sampler = DATA_SAMPLERS.build(dict(sampler_cfg, dataset=dataset, seed=seed))
    order = list(iter(sampler))[: max_batches * batch_size]
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    real = sum(lengths[i] for c in chunks for i in c)
    slots = sum(len(c) * max(lengths[i] for i in c) for c in chunks)
    return {
        "sampler": type_name(sampler_cfg.get("type")),
        "seed": seed,
        "batches": len(chunks),
        "padded_share": real / slots if slots else None,
    }


def llava_figures(
    view: LLaVAView, dataset, collate_kwargs: Mapping, dataset_max_length: int | None = None
) -> dict:
    """Image and text samples, image-token share, lengths before and after the expansion, of a
    ``LLaVADataset`` (its ``max_length``: samples that long were cut)."""
    text = dataset.text_data
    p = view.image_tokens["image_tokens"]
    raw = [len(ids) for ids in text["input_ids"]]
    images = [sum(1 for t in ids if t == IMAGE_TOKEN_INDEX) for ids in text["input_ids"]]
    names = text["image"] if "image" in text.column_names else [None] * len(raw)
    folder = getattr(dataset, "image_folder", None) or ""
    missing = [
        i
        for i, name in enumerate(names)
        if name is not None and not os.path.exists(os.path.join(folder, name))
    ]
    expanded = [n + k * (p - 1) for n, k in zip(raw, images)]
    image_samples = [i for i, k in enumerate(images) if k]
    return {
        **view.image_tokens,
        "image_source": f"{view.image_tokens['model_type']} image_size="
        f"{view.image_tokens['image_size']} patch_size="
        f"{view.image_tokens['patch_size']}: (image_size // patch_size)^2 "
        "patches, CLS dropped by LLaVAModel",
        "processor_crop": _crop_size(dataset),
        "collate_image_tokens": collate_kwargs.get("image_tokens"),
        "image_samples": len(image_samples),
        "text_samples": len(raw) - len(image_samples),
        "placeholders_per_sample_max": max(images, default=0),
        "many_placeholders": [i for i, k in enumerate(images) if k > 1][:10],
        "samples_naming_an_image": sum(n is not None for n in names),
        "missing_images": {"count": len(missing), "first_indices": missing[:10]},
        "image_tokens_total": sum(k * p for k in images),
        "tokens_expanded": sum(expanded),
        "image_token_share": sum(k * p for k in images) / sum(expanded) if expanded else None,
        "lengths_as_dataset": length_percentiles(raw),  # each image one token
        "lengths_image_samples": length_percentiles([expanded[i] for i in image_samples]),
        "lengths_text_samples": length_percentiles([e for e, k in zip(expanded, images) if not k]),
        "dataset_max_length": dataset_max_length,
        "truncated": [i for i, n in enumerate(raw) if n == dataset_max_length][:10],
        "truncated_count": sum(n == dataset_max_length for n in raw),
        "llm_max_position": view.llm_max_position,
    }


def llava_data_of(view: LLaVAView, dataset) -> list[str]:
    """The run's own data checks (``data.llava_dataset_checks``) on the doctor's dataset."""
    from xtuner_rope.data.llava_dataset_checks import llava_data_problems

    text = dataset.text_data
    ids = text["input_ids"]
    names = text["image"] if "image" in text.column_names else [None] * len(ids)
    return llava_data_problems(
        ids,
        names,
        getattr(dataset, "image_folder", None) or "",
        view.image_tokens["image_tokens"],
        max_position=view.llm_max_position,
    )


def llava_warnings(figures: Mapping | None) -> list[str]:
    """Samples ``LLaVADataset`` probably cut (exactly its ``max_length`` ids long)."""
    if not figures or not figures["truncated_count"]:
        return []
    return [
        f"{figures['truncated_count']} samples exactly max_length="
        f"{figures['dataset_max_length']} ids long (an image counted as one), probably cut "
        f"silently by LLaVADataset (first: {', '.join(map(str, figures['truncated']))})"
    ]


def llava_lines(figures: Mapping | None) -> list[str]:
    """The doctor's summary lines for a LLaVA config."""
    if not figures:
        return []
    share = figures["image_token_share"]
    return [
        f"images       {figures['image_samples']} image samples, {figures['text_samples']} "
        f"text-only; each image is {figures['image_tokens']} tokens for the LLM "
        f"({figures['image_source']}); image tokens {figures['image_tokens_total']} of "
        f"{figures['tokens_expanded']} ({'n/a' if share is None else f'{100 * share:.1f}%'})",
        "             all lengths, rows and shares below count the expanded sequence "
        "(XTuner's prepare_inputs_labels_for_multimodal)",
        f"             image samples {percentiles_text(figures['lengths_image_samples'])}",
        f"             text samples  {percentiles_text(figures['lengths_text_samples'])}",
        f"             as the dataset counts them (image = 1 token) "
        f"{percentiles_text(figures['lengths_as_dataset'])}",
    ] + _sampler_line(figures.get("sampler_order"))


def _sampler_line(order: Mapping | None) -> list[str]:
    if not order or order["padded_share"] is None:
        return []
    return [
        f"             in {order['sampler']} order (seed {order['seed']}, first "
        f"{order['batches']} batches) padded batches hold {100 * order['padded_share']:.1f}%"
        " real tokens (XTuner default_collate_fn)"
    ]
