"""A tiny CLIP vision tower and image processor, built locally and deterministically.

XTuner's LLaVA configs load ``CLIPVisionModel.from_pretrained(visual_encoder_name_or_path)``
and ``CLIPImageProcessor.from_pretrained(...)`` from the same directory. :func:`save_tiny_clip`
writes such a directory from ``transformers.CLIPVisionConfig`` (2 layers, hidden 32, 56x56
images in 14x14 patches: 16 image tokens per image after XTuner drops the CLS token) with
seeded weights, so nothing is downloaded. ``python tools/make_tiny.py --family clip`` writes one.
"""

from __future__ import annotations

from pathlib import Path

import torch

# 56 / 14 = 4 patches a side: 16 patch embeddings per image reach the LLM.
TINY_CLIP_KWARGS = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=56,
    patch_size=14,
    projection_dim=32,
)


def image_tokens(
    image_size: int = TINY_CLIP_KWARGS["image_size"],
    patch_size: int = TINY_CLIP_KWARGS["patch_size"],
) -> int:
    """How many positions one image takes in the LLM's sequence (patches, CLS dropped)."""
    return (image_size // patch_size) ** 2


def build_tiny_clip(seed: int = 0, **overrides):
    """The tiny ``CLIPVisionModel`` (seeded) and its ``CLIPImageProcessor``."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(**{**TINY_CLIP_KWARGS, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPVisionModel(config)
    size = config.image_size
    processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    return model.eval(), processor


def save_tiny_clip(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny CLIP vision tower and image processor to ``out_dir``; return it."""
    out_dir = Path(out_dir)
    model, processor = build_tiny_clip(seed=seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir
