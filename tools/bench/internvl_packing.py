"""Real-token share of InternVL batches: XTuner's padding vs internvl_collate_fn packing.

A mix of short image dialogues (drawn pictures, one-line questions) and short text-only turns,
in LLaVA format (``xtuner_rope.demo.llava_data``), tokenized and tiled by XTuner's real
``InternVL_V1_5_Dataset`` on the tiny InternVL checkpoint (tiny InternLM2 LLM, InternLM2 chat
template, 16 tokens per 112 px tile). The sample lengths are what the LLM sees (image tokens
written into the ids by the dataset). Each sampler batch, shuffled, is collated

- padded: XTuner's ``default_collate_fn`` (one sample per row, padded to the batch's longest);
- packed: ``internvl_collate_fn`` (whole samples into rows of at most ``--max-length``).

Usage:
    python tools/bench/internvl_packing.py [--images 400] [--texts 400] [--batch-size 8]
"""

import argparse
import random
import tempfile
from pathlib import Path

import xtuner_rope
from xtuner_rope.demo.llava_data import write_llava_data
from xtuner_rope.demo.resources import tiny_checkpoint
from xtuner_rope.demo.tiny_internvl import save_tiny_internvl
from xtuner_rope.doctor.internvl_stats import real_token_shares


def main() -> None:
    xtuner_rope.activate()  # the modules are driven directly: patches and registries first
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=400, help="image dialogues")
    parser.add_argument("--texts", type=int, default=400, help="text-only dialogues")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per batch (stock: 8)")
    parser.add_argument("--max-length", type=int, default=8192, help="row capacity (stock 8192)")
    args = parser.parse_args()
    from xtuner.dataset import InternVL_V1_5_Dataset
    from xtuner.utils import PROMPT_TEMPLATE

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        llm = tiny_checkpoint(str(tmp / "tiny-internlm2"))
        model = save_tiny_internvl(llm, tmp / "tiny-internvl2")
        data = write_llava_data(tmp / "data", n_images=args.images, n_text=args.texts)
        dataset = InternVL_V1_5_Dataset(
            model_path=str(model),
            template=PROMPT_TEMPLATE.internlm2_chat,
            data_paths=str(data),
            image_folders=str(data.parent / "images"),
            max_length=args.max_length,
        )
        lengths = [len(dataset.prepare_data(i)["input_ids"]) for i in range(len(dataset))]
    random.Random(0).shuffle(lengths)
    padded, packed = real_token_shares(lengths, args.batch_size, args.max_length)
    print(
        f"{args.images} image + {args.texts} text-only dialogues ({min(lengths)}-{max(lengths)} "
        f"tokens, {dataset.patch_token} per tile), shuffled batches of {args.batch_size}:\n"
        f"  padded, default_collate_fn (stock)       real tokens {padded:6.1%}\n"
        f"  packed, internvl_collate_fn              real tokens {packed:6.1%}"
    )


if __name__ == "__main__":
    main()
