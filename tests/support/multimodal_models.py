"""Tiny XTuner LLaVA and InternVL models in one process, each with an unpatched copy, and
short samples for them.

``llava_models``: XTuner's real ``LLaVAModel`` (tiny CLIP + tiny InternLM2 with hub-style remote
code), patched as a run patches it, and a deep copy taken before (unpatched). ``llava_samples``:
short dialogues, alternately with an image placeholder and text-only. ``internvl_models`` /
``internvl_samples``: the same for XTuner's ``InternVL_V1_5`` on the tiny InternVL checkpoint
(tiny InternLM2 inside), loaded in fp32 with eager attention as the start-up loads it on CPU.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import stock_configs as sc
import torch
from mmengine.config import ConfigDict

from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX
from xtuner_rope.models.dispatch import patch_model


def llava_models(root: Path, rope_scaling=None, max_position_embeddings=None, **options):
    """A patched ``LLaVAModel`` and an unpatched copy; ``rope_scaling`` /
    ``max_position_embeddings`` edit the LLM's config.json; ``options`` go to ``LLaVAModel``
    (default: LLM and CLIP frozen)."""
    from transformers import AutoModelForCausalLM, CLIPVisionModel
    from xtuner.model import LLaVAModel

    from xtuner_rope.demo.tiny_clip import save_tiny_clip

    sc.ensure_tiny_model()
    llm = sc.tiny_with_remote_code(root / "tiny-internlm2-remote")
    if rope_scaling is not None:
        config = json.loads((llm / "config.json").read_text())
        config.update(rope_scaling=rope_scaling, max_position_embeddings=max_position_embeddings)
        (llm / "config.json").write_text(json.dumps(config, indent=2))
    clip = save_tiny_clip(root / "tiny-clip")
    torch.manual_seed(0)
    model = (
        LLaVAModel(
            llm=ConfigDict(
                type=AutoModelForCausalLM.from_pretrained,
                pretrained_model_name_or_path=str(llm),
                trust_remote_code=True,
                torch_dtype=torch.float32,
            ),
            visual_encoder=ConfigDict(
                type=CLIPVisionModel.from_pretrained, pretrained_model_name_or_path=str(clip)
            ),
            **{"freeze_llm": True, "freeze_visual_encoder": True, **options},
        )
        .float()
        .eval()
    )
    reference = copy.deepcopy(model)  # unpatched
    patch_model(model)
    return model, reference


def llava_samples(n: int, seed: int) -> list[dict]:
    """Short dialogues (1..39 tokens), alternately with an image (placeholder at column 1)
    and text-only; the first half of each is unsupervised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randint(3, 1000, (length,), generator=g)
        image = i % 2 == 0 and length > 1
        if image:
            ids[1] = IMAGE_TOKEN_INDEX
        labels = ids.masked_fill(ids == IMAGE_TOKEN_INDEX, -100)
        labels[: length // 2] = -100
        pixels = torch.randn(3, 56, 56, generator=g) if image else torch.zeros(3, 56, 56)
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "pixel_values": pixels})
    return out


def internvl_models(root: Path, **options):
    """A patched ``InternVL_V1_5`` (tiny InternVL around a tiny InternLM2), an unpatched copy,
    and ``(img_context_token_id, tokens per tile, tile side)``; ``options`` go to
    ``InternVL_V1_5`` (default: LLM and vision model frozen)."""
    from xtuner.model.internvl import InternVL_V1_5

    from xtuner_rope.compat.xtuner_internvl import INTERNVL_LOAD
    from xtuner_rope.demo.tiny_internvl import save_tiny_internvl

    sc.ensure_tiny_model()
    path = save_tiny_internvl(sc.tiny_with_remote_code(root / "llm"), root / "internvl")
    kept = dict(INTERNVL_LOAD)
    INTERNVL_LOAD.update(torch_dtype=torch.float32, attn_implementation="eager")
    try:
        torch.manual_seed(0)
        options = {"freeze_llm": True, "freeze_visual_encoder": True, **options}
        model = InternVL_V1_5(model_path=str(path), **options)
    finally:
        INTERNVL_LOAD.clear()
        INTERNVL_LOAD.update(kept)
    model = model.float().eval()
    reference = copy.deepcopy(model)  # unpatched
    patch_model(model)
    chat = model.model
    side = chat.config.force_image_size or chat.config.vision_config.image_size
    return model, reference, (int(chat.img_context_token_id), int(chat.num_image_token), side)


def internvl_samples(n: int, seed: int, context_id: int, per_tile: int, side: int) -> list[dict]:
    """Short dialogues; every other one holds an image of 1 or 2 tiles (its ``<IMG_CONTEXT>``
    ids after column 1), the others one zero tile (text-only, as XTuner's dataset gives)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(2, 30, (1,), generator=g))
        ids = torch.randint(3, 1000, (length,), generator=g)
        tiles = 1 + i % 4 // 2 if i % 2 == 0 else 0
        if tiles:
            ids = torch.cat([ids[:1], torch.full((tiles * per_tile,), context_id), ids[1:]])
        labels = ids.masked_fill(ids == context_id, -100)
        labels[: ids.numel() // 2] = -100
        pixels = (
            torch.randn(tiles, 3, side, side, generator=g)
            if tiles
            else torch.zeros(1, 3, side, side)
        )
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "pixel_values": pixels})
    return out
