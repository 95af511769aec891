"""The doctor's figures for XTuner's InternVL configs: image tokens, cut images, missing files.

``InternVL_V1_5_Dataset`` silently replaces a sample whose image is missing, and a
``max_length`` that cuts image tokens makes wrong vision tokens: both named with the sample.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import torch

from xtuner_rope.batch.internvl_tiles import image_tiles
from xtuner_rope.data.cut_counts import kept_counts, length_quantile
from xtuner_rope.data.truncation import FIRST_INDICES, IGNORE_INDEX
from xtuner_rope.ops.packing import plan_packs

__all__ = ["internvl_figures", "internvl_lines", "internvl_problems", "real_token_shares"]


def _image_path(dataset, i: int) -> str | None:
    image = dataset.data[i].get("image")
    if not image:
        return None
    name = image[0] if isinstance(image, (list, tuple)) else image
    return os.path.join(dataset.image_folder[i] or "", name)


def real_token_shares(lengths: list[int], batch_size: int, max_length: int) -> tuple[float, float]:
    """Real-token share of batches in order: padded to each batch's longest, and packed."""
    real = padded = packed = 0
    for at in range(0, len(lengths), batch_size):
        batch = lengths[at : at + batch_size]
        rows = plan_packs(batch, max(max_length, max(batch)))
        real += sum(batch)
        padded += len(batch) * max(batch)
        packed += len(rows) * max(sum(batch[i] for i in row) for row in rows)
    return real / max(padded, 1), real / max(packed, 1)


def internvl_figures(cfg, dataset, batch_size: int) -> dict | None:
    """Image figures of an ``InternVL_V1_5_Dataset`` (None for any other dataset)."""
    from xtuner_rope.config.internvl import checkpoint_config, is_internvl
    from xtuner_rope.demo.tiny_internvl import tokens_per_tile

    if not is_internvl(cfg) or not hasattr(dataset, "prepare_data"):
        return None
    config, where = checkpoint_config(cfg)
    p = tokens_per_tile(config) if config else int(dataset.patch_token)
    context = dataset.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    missing, cut, lengths, images, whole = [], [], [], 0, []
    for i in range(len(dataset.data)):
        path = _image_path(dataset, i)
        if path is not None and "s3://" not in path and not os.path.isfile(path):
            missing.append({"index": i, "id": dataset.data[i].get("id"), "path": path})
            continue
        item = _uncut_item(dataset, i)  # XTuner's own tiling and tokenization
        whole.append((i, item["input_ids"], item["labels"]))
        ids = torch.as_tensor(item["input_ids"][: dataset.max_length])  # XTuner's cut
        tiles = image_tiles(item["pixel_values"]) if path is not None else 0
        images += path is not None
        kept = int((ids == context).sum())
        if kept != tiles * p:
            cut.append(
                {"index": i, "id": dataset.data[i].get("id"), "kept": kept, "expected": tiles * p}
            )
        lengths.append(int(ids.numel()))
    padded, packed = (
        real_token_shares(lengths, batch_size, int(dataset.max_length)) if lengths else (0, 0)
    )
    return {
        "tokens_per_tile": p,
        "source": where,
        "max_tiles": int(dataset.max_dynamic_patch) + int(bool(dataset.use_thumbnail)),
        "image_samples": images,
        "text_samples": len(lengths) - images,
        "max_length": int(dataset.max_length),
        "missing_images": missing,
        "cut_images": cut,
        "real_token_share": {"padded": padded, "packed": packed, "batch_size": batch_size},
        "truncation": internvl_truncation(whole, int(dataset.max_length)),
    }


def _uncut_item(dataset, i: int) -> dict:
    """``dataset.prepare_data(i)`` before ``get_inputid_labels``' cut at ``max_length``."""
    saved = dataset.max_length
    dataset.max_length = sys.maxsize  # XTuner cuts where len(input_ids) > max_length: never
    try:
        return dataset.prepare_data(i)
    finally:
        dataset.max_length = saved


def internvl_truncation(items: list[tuple[int, list, list]], max_length: int) -> dict:
    """``data.truncation``'s figures of what ``InternVL_V1_5_Dataset`` cuts at ``max_length`` from
    uncut ``(index, input_ids, labels)`` items (nothing dropped)."""
    lengths = [len(ids) for _, ids, _ in items]
    labels = [sum(x != IGNORE_INDEX for x in lab) for _, _, lab in items]
    kept = [sum(x != IGNORE_INDEX for x in lab[:max_length]) for _, _, lab in items]
    cut = [i for i, ids, _ in items if len(ids) > max_length]  # dataset indices
    ordered = sorted(lengths)
    n = len(ordered)
    return {
        "max_length": max_length,
        "step": "XTuner's InternVL_V1_5_Dataset",
        "dialogues": n,
        "documents": 0,
        "pretraining": False,
        "truncated": len(cut),
        "dropped": 0,
        "split": 0,
        "tokens": kept_counts(sum(lengths), sum(min(k, max_length) for k in lengths)),
        "labels": kept_counts(sum(labels), sum(kept)),
        "keep_all": ordered[-1] if n else None,
        "keep_99": length_quantile(ordered, 0.99),
        "first_truncated": cut[:FIRST_INDICES],
    }


def _first(items: list[dict]) -> str:
    return ", ".join(f"sample {x['index']} (id {x['id']})" for x in items[:3])


def internvl_problems(figures: Mapping | None) -> list[str]:
    """Missing image files and cut image tokens, each named with its samples."""
    if not figures:
        return []
    problems = []
    missing = figures["missing_images"]
    if missing:
        problems.append(
            f"train_dataloader.dataset.image_folders: {len(missing)} sample(s) name an image "
            f"file that is not there (first: {_first(missing)}: {missing[0]['path']}): "
            "XTuner's InternVL_V1_5_Dataset prints the error and trains a random other sample "
            "in its place. Fix the path or drop the sample."
        )
    cut = figures["cut_images"]
    if cut:
        problems.append(
            f"max_length={figures['max_length']}: cuts the image tokens of {len(cut)} "
            f"sample(s) (first: {_first(cut)}: {cut[0]['kept']} of {cut[0]['expected']} "
            "<IMG_CONTEXT> kept): InternVL_V1_5 would write the wrong vision tokens, and the "
            "batch check refuses the step. Raise max_length or lower max_dynamic_patch."
        )
    return problems


def internvl_lines(figures: Mapping | None) -> list[str]:
    """The doctor's text lines for an InternVL dataset."""
    if not figures:
        return []
    share = figures["real_token_share"]
    return [
        f"images       InternVL: {figures['tokens_per_tile']} LLM tokens per tile (from "
        f"{figures['source']}), up to {figures['max_tiles']} tiles per image; "
        f"{figures['image_samples']} image and {figures['text_samples']} text-only samples",
        f"             real tokens {share['padded']:.1%} padded (default_collate_fn), "
        f"{share['packed']:.1%} packed by internvl_collate_fn(max_length="
        f"{figures['max_length']}), batches of {share['batch_size']} in dataset order",
    ]
