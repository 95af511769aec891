"""A tiny CLIP vision tower and image processor (56 px, 14 px patches: 16 tokens), built offline."""

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


def image_tokens() -> int:
    """How many positions one tiny image takes in the LLM's sequence (patches, CLS dropped)."""
    return (TINY_CLIP_KWARGS["image_size"] // TINY_CLIP_KWARGS["patch_size"]) ** 2


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
