"""Padding share of LLaVA batches as the LLM sees them: XTuner's padding vs llava_collate_fn.

A mix of short image dialogues (drawn pictures, one-line questions) and short text-only turns,
in LLaVA format (``xtuner_rope.demo.llava_data``), tokenized by XTuner's real ``LLaVADataset``
(tiny InternLM2 tokenizer, ``internlm2_chat`` template, tiny CLIP image processor). Each
sampler batch is collated

- padded: XTuner's ``default_collate_fn`` (one sample per row), over shuffled batches and over
  the stock configs' ``LengthGroupedSampler`` (batches of similar ``modality_length``);
- packed: ``llava_collate_fn(pack=True)`` on the same shuffled batches.

The share is counted after the image expansion, where the LLM's compute goes: each row's
length is its real tokens with every placeholder counted as ``P`` patch tokens, and the
expanded batch is as wide as its longest row. ``P`` is 16 for the tiny CLIP (56 px / 14) and
576 for the stock configs' CLIP-L/14 at 336 px (the same samples, counted with that ``P``).

Usage:
    python tools/bench/llava_packing.py [--images 400] [--texts 400] [--batch-size 16]
"""

import argparse
import random
import tempfile

import torch

import xtuner_rope
from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX
from xtuner_rope.data.collate_llava import llava_collate_fn
from xtuner_rope.demo.llava_data import write_llava_data
from xtuner_rope.demo.resources import tiny_checkpoint
from xtuner_rope.demo.tiny_clip import save_tiny_clip


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=400, help="image dialogues")
    parser.add_argument("--texts", type=int, default=400, help="text-only dialogues")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per sampler batch")
    parser.add_argument(
        "--max-length",
        type=int,
        default=2048,
        help="packed row capacity after the expansion (the stock configs' LLM "
        "sees 2048: max_length = 2048 - 576 ids + 576 patch tokens)",
    )
    parser.add_argument("--image-tokens", type=int, nargs="+", default=[16, 576])
    parser.add_argument("--model", default="models/tiny-internlm2")
    return parser.parse_args()


def dataset(args, root: str):
    from transformers import AutoTokenizer, CLIPImageProcessor
    from xtuner.dataset import LLaVADataset
    from xtuner.dataset.map_fns import llava_map_fn, template_map_fn_factory
    from xtuner.utils import PROMPT_TEMPLATE

    llm = tiny_checkpoint(args.model)
    clip = save_tiny_clip(f"{root}/clip")
    data = write_llava_data(f"{root}/data", n_images=args.images, n_text=args.texts)
    return LLaVADataset(
        data_path=str(data),
        image_folder=str(data.parent / "images"),
        tokenizer=dict(
            type=AutoTokenizer.from_pretrained,
            pretrained_model_name_or_path=llm,
            trust_remote_code=True,
            padding_side="right",
        ),
        image_processor=dict(
            type=CLIPImageProcessor.from_pretrained, pretrained_model_name_or_path=str(clip)
        ),
        dataset_map_fn=llava_map_fn,
        template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.internlm2_chat),
        max_length=2048,
        pad_image_to_square=True,
    )


def expanded_rows(data: dict, p: int) -> list[int]:
    """Each row's length after the expansion: real tokens, a placeholder counting ``p``."""
    mask = data["attention_mask"]
    images = ((data["input_ids"] == IMAGE_TOKEN_INDEX) & mask).sum(dim=1)
    return (mask.sum(dim=1) + images * (p - 1)).tolist()


def share(batches: list[list[int]]) -> tuple[float, int, int]:
    """Padding share of expanded batches (rows padded to the longest), rows, positions."""
    real = sum(sum(rows) for rows in batches)
    positions = sum(len(rows) * max(rows) for rows in batches)
    return 1 - real / positions, sum(len(rows) for rows in batches), positions


def main():
    xtuner_rope.activate()  # the modules are driven directly: patches and registries first
    from xtuner.dataset.collate_fns import default_collate_fn
    from xtuner.dataset.samplers import LengthGroupedSampler

    args = parse_args()
    with tempfile.TemporaryDirectory() as root:
        ds = dataset(args, root)
        items = [ds[i] for i in range(len(ds))]
    n, bs = len(items), args.batch_size
    order = list(range(n))
    random.Random(0).shuffle(order)
    shuffled = [order[i : i + bs] for i in range(0, n, bs)]
    grouped_order = list(
        LengthGroupedSampler(
            ds, per_device_batch_size=bs, length_property="modality_length", seed=0
        )
    )
    grouped = [grouped_order[i : i + bs] for i in range(0, n, bs)]
    text_lengths = [len(x["input_ids"]) for x in items]
    print(
        f"{n} samples ({args.images} with an image, {args.texts} text-only), "
        f"{min(text_lengths)}-{max(text_lengths)} ids each, batches of {bs}"
    )
    for p in args.image_tokens:
        longest = max(
            len(x["input_ids"]) + (p - 1) * (IMAGE_TOKEN_INDEX in x["input_ids"]) for x in items
        )
        max_length = args.max_length
        padded = [
            expanded_rows(default_collate_fn([items[i] for i in b])["data"], p) for b in shuffled
        ]
        stock = [
            expanded_rows(default_collate_fn([items[i] for i in b])["data"], p) for b in grouped
        ]
        packed = [
            expanded_rows(
                llava_collate_fn(
                    [items[i] for i in b],
                    max_length=max_length,
                    image_tokens=p,
                    return_hf_format=True,
                ),
                p,
            )
            for b in shuffled
        ]
        print(
            f"P = {p} patch tokens per image (longest sample {longest}, packed rows of at "
            f"most {max_length}):"
        )
        for name, batches in (
            ("padded, shuffled batches", padded),
            ("padded, LengthGroupedSampler (stock)", stock),
            ("packed, llava_collate_fn", packed),
        ):
            pad, rows, positions = share(batches)
            print(f"  {name:38s} padding share {pad:6.1%}  ({rows} rows, {positions} positions)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
