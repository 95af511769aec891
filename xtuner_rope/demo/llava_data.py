"""A small LLaVA-format training set: drawn images with short questions, plus text-only turns.

Deterministic: PIL-drawn shapes with one-line questions, mixed with the first exchange of the
shipped sample dialogues. ``python tools/make_llava_data.py --out DIR`` runs it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "purple": (140, 60, 180),
}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = (
    "What is in the picture?",
    "Describe the image in a few words.",
    "Which shape and colour do you see?",
    "What colour is the shape?",
)
IMAGE_TOKEN = "<image>"  # xtuner.utils.DEFAULT_IMAGE_TOKEN


def draw_shape(shape: str, colour: str, size: int = 64):
    """A ``size`` x ``size`` RGB picture of one filled ``shape`` in ``colour`` on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    box = (size // 8, size // 8, size - size // 8, size - size // 8)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(size // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
    return image


def _text_samples(n: int) -> list[dict]:
    """The first exchange of ``n`` sample dialogues, in LLaVA's conversation format."""
    from .sample_dialogues import sample_dialogues

    rows = []
    for i, dialogue in enumerate(d["messages"] for d in sample_dialogues(n)):
        user = next(m["content"] for m in dialogue if m["role"] == "user")
        reply = next(m["content"] for m in dialogue if m["role"] == "assistant")
        rows.append(
            {
                "id": f"text-{i}",
                "conversations": [
                    {"from": "human", "value": user},
                    {"from": "gpt", "value": reply},
                ],
            }
        )
    return rows


def write_llava_data(
    out_dir: str | Path, n_images: int = 12, n_text: int = 12, seed: int = 0
) -> Path:
    """Write ``images/*.png`` and ``llava_data.json`` under ``out_dir``; return the JSON path.

    ``n_images`` dialogues with one drawn picture each, ``n_text`` text-only ones (the sample
    dialogues); ``seed`` picks shapes, colours, questions and the interleaving."""
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    image_rows = []
    for i in range(n_images):
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        name = f"{i:03d}_{colour}_{shape}.png"
        draw_shape(shape, colour).save(out_dir / "images" / name)
        image_rows.append(
            {
                "id": f"image-{i}",
                "image": name,
                "conversations": [
                    {"from": "human", "value": f"{IMAGE_TOKEN}\n{rng.choice(QUESTIONS)}"},
                    {"from": "gpt", "value": f"A {colour} {shape}."},
                ],
            }
        )
    text_rows = _text_samples(n_text)
    rows = image_rows[:1] + rng.sample(
        image_rows[1:] + text_rows, len(image_rows) - 1 + len(text_rows)
    )  # an image row first: its keys
    path = out_dir / "llava_data.json"
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return path
