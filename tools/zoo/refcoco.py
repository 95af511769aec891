"""A tiny RefCOCO annotation set for XTuner's ``RefCOCOJsonDataset`` / ``InvRefCOCOJsonDataset``.

Those classes read no LLaVA conversations: each entry of their JSON list is one referring
expression, ``{"id", "image", "sents", "bbox": [x, y, w, h] (pixels), "height", "width"}``,
and they make the conversations themselves (``[refer] where is {sents}?`` answered with the
box in hundredths of the image, and the inverse). :func:`write_refcoco_data` draws pictures
of two shapes each, whose boxes are known exactly, and writes one expression per shape.
:func:`localize_refcoco` points a config's ``refcoco_path`` at that file.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from xtuner_rope.demo.llava_data import COLOURS, SHAPES

WIDTH, HEIGHT, SIDE = 96, 64, 32  # two shapes side by side, each in a SIDE-pixel box


def _draw(image, shape: str, colour: str, box: tuple[int, int, int, int]) -> None:
    from PIL import ImageDraw

    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def refcoco_entries(n_images: int, images: Path, seed: int = 0) -> list[dict]:
    """Draw ``n_images`` pictures into ``images`` and return their expressions (two each).

    Args:
        n_images: Pictures to draw; each holds a left and a right shape of different colours.
        images: The folder the config's ``image_folder`` names (``image`` is relative to it).
        seed: Picks shapes, colours and positions.

    Returns:
        RefCOCO entries (``bbox`` is ``[x, y, w, h]`` in pixels, as RefCOCO stores it).
    """
    from PIL import Image

    rng = random.Random(seed)
    images.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(n_images):
        name = f"refcoco_{i:03d}.png"
        image = Image.new("RGB", (WIDTH, HEIGHT), (255, 255, 255))
        colours = rng.sample(sorted(COLOURS), 2)
        for side, colour in zip(("left", "right"), colours):
            shape = rng.choice(SHAPES)
            x = rng.randint(2, WIDTH // 2 - SIDE - 2) + (WIDTH // 2 if side == "right" else 0)
            y = rng.randint(2, HEIGHT - SIDE - 2)
            _draw(image, shape, colour, (x, y, x + SIDE, y + SIDE))
            entries.append(
                {
                    "id": f"refcoco-tiny-{i:03d}-{side}",
                    "image": name,
                    "sents": f"the {colour} {shape} on the {side}",
                    "bbox": [x, y, SIDE, SIDE],
                    "height": HEIGHT,
                    "width": WIDTH,
                }
            )
        image.save(images / name)
    return entries


def write_refcoco_data(root: Path, images: Path, n_images: int = 6) -> Path:
    """Write ``refcoco_train.json`` under ``root`` (pictures into ``images``); return its path."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "refcoco_train.json"
    path.write_text(json.dumps(refcoco_entries(n_images, images), indent=1), encoding="utf-8")
    return path


def localize_refcoco(text: str, refcoco_json: Path | None) -> str:
    """Point a config's ``refcoco_path`` setting at ``refcoco_json`` (no such setting: as is)."""
    if refcoco_json is None:
        return text
    return re.sub(r"^refcoco_path = .*$", f'refcoco_path = "{refcoco_json}"', text, flags=re.M)
