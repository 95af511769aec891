"""Start-up findings of LLaVA configs against their vision tower (``image_tokens``, crop size).

``llava_collate_fn``'s ``image_tokens`` must be the ``P = (image_size // patch_size) ** 2``
``LLaVAModel`` inserts, and the image processor must crop to the tower's size. Read from the
tower's files before anything is built; a tower not readable offline yet is judged again by
``ValidatedRoPEHook``.
"""

from __future__ import annotations

from collections.abc import Mapping

from mmengine.config import Config

from xtuner_rope.compat.mmengine_config import config_dict

from .fields import type_name
from .findings import Finding
from .startup import register_findings

__all__ = [
    "crop_size_findings",
    "image_tokens_finding",
    "image_tokens_from_config",
    "llava_collate_findings",
    "tower_image_tokens",
]


def _get(node: object, key: str, default: object = None) -> object:
    return node.get(key, default) if isinstance(node, Mapping) else default


def tower_image_tokens(path: object, local_only: bool = False) -> dict:
    """``P``, the patch embeddings one image becomes, from the vision tower's config at ``path``
    (``local_only``: on disk only): ``{'image_tokens': P, 'image_size', 'patch_size',
    'model_type', 'path'}``.

    Raises:
        ValueError: no path, or no int ``image_size`` / ``patch_size`` (not a ViT-style tower).
        OSError: the config cannot be read.
    """
    from transformers import AutoConfig

    if path is None:
        raise ValueError(
            "model.visual_encoder.pretrained_model_name_or_path: expected the vision tower's "
            "path, got none. Set visual_encoder_name_or_path in the config."
        )
    config = AutoConfig.from_pretrained(str(path), local_files_only=local_only)
    return image_tokens_from_config(config, str(path))


def image_tokens_from_config(config: object, path: str) -> dict:
    """:func:`tower_image_tokens` of a loaded tower config (a built model's ``.config``).

    Raises:
        ValueError: no int ``image_size`` / ``patch_size`` (not a ViT-style tower).
    """
    vision = getattr(config, "vision_config", config)  # a full CLIPConfig holds the tower's
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if not isinstance(size, int) or not isinstance(patch, int) or patch < 1:
        raise ValueError(
            f"model.visual_encoder ({path}): expected a ViT-style config with int "
            f"image_size and patch_size, got image_size={size!r}, patch_size={patch!r} "
            f"({type(vision).__name__}). XTuner's LLaVAModel drops one CLS token per "
            "image: use a CLIP tower."
        )
    # (size / patch)^2 patch tokens + CLS; LLaVAModel keeps [:, 1:].
    return {
        "image_tokens": (size // patch) ** 2,
        "image_size": size,
        "patch_size": patch,
        "model_type": getattr(vision, "model_type", None),
        "path": path,
    }


def image_tokens_finding(asked: object, tower: Mapping) -> Finding | None:
    """The refusal of ``llava_collate_fn(image_tokens=asked)`` for ``tower``
    (:func:`tower_image_tokens`); None when equal.
    """
    p = tower["image_tokens"]
    if asked == p:
        return None
    effect = (
        "image rows would come out longer than max_length once expanded and train silently"
        if isinstance(asked, int) and asked < p
        else "image samples would look longer than they are and the first image batch would "
        "be refused as over max_length"
    )
    return Finding(
        "train_dataloader.collate_fn.image_tokens",
        f"{asked!r}, but the vision tower (model.visual_encoder, {tower['path']}) gives {p} "
        f"patch embeddings per image ({tower['model_type']} image_size={tower['image_size']} "
        f"patch_size={tower['patch_size']}: (image_size // patch_size)^2, CLS dropped by "
        f"LLaVAModel): llava_collate_fn plans its rows on wrong lengths ({effect})",
        f"set image_tokens={p}",
    )


@register_findings("llava_tower")
def llava_collate_findings(cfg: Config) -> list[Finding]:
    """``llava_collate_fn``'s ``image_tokens`` against the tower's ``P`` (see the module)."""
    collate = _get(_get(config_dict(cfg), "train_dataloader"), "collate_fn")
    if type_name(_get(collate, "type")) != "llava_collate_fn":
        return []
    encoder = _get(_get(config_dict(cfg), "model"), "visual_encoder")
    try:
        tower = tower_image_tokens(_get(encoder, "pretrained_model_name_or_path"), local_only=True)
    except (OSError, ValueError):
        # Not readable offline (yet), or not a ViT tower (the doctor names that): the re-check
        # before the first step reads it again once the model is loaded.
        return []
    finding = image_tokens_finding(_get(collate, "image_tokens"), tower)
    return [] if finding is None else [finding]


def _processor_crop(path: object) -> tuple[int, int] | None:
    """``(height, width)`` a local image processor crops (or resizes) to; None if unknown."""
    import json
    from pathlib import Path

    config = Path(path) / "preprocessor_config.json" if isinstance(path, str) else None
    if config is None or not config.is_file():
        return None
    data = json.loads(config.read_text())
    crop = data.get("crop_size") if data.get("do_center_crop", True) else None
    crop = crop or data.get("size")
    if isinstance(crop, Mapping) and "height" in crop and "width" in crop:
        return int(crop["height"]), int(crop["width"])
    return None


@register_findings("llava_tower")
def crop_size_findings(cfg: Config) -> list[Finding]:
    """The LLaVA dataset's image processor against the tower's ``image_size`` (see the module)."""
    model = _get(config_dict(cfg), "model")
    if type_name(_get(model, "type")) != "LLaVAModel":
        return []
    dataset = _get(_get(config_dict(cfg), "train_dataloader"), "dataset")
    crop = _processor_crop(_get(_get(dataset, "image_processor"), "pretrained_model_name_or_path"))
    path = _get(_get(model, "visual_encoder"), "pretrained_model_name_or_path")
    try:
        size = tower_image_tokens(path, local_only=True)["image_size"]
    except (OSError, ValueError):
        return []
    if crop is None or crop == (size, size):
        return []
    return [
        Finding(
            "image_processor",
            f"crops images to {crop[0]}x{crop[1]}, but the vision tower (model.visual_encoder, "
            f"{path}) takes {size}x{size}: its position embeddings do not fit and the first "
            "step fails",
            "use the tower's own image processor (the same path as visual_encoder_name_or_path)",
        )
    ]
