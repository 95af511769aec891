"""Write a small LLaVA-format set: drawn images with short questions plus text-only dialogues.

    python tools/make_llava_data.py --out data/tiny_llava

Writes ``DIR/llava_data.json`` (XTuner's ``LLaVADataset`` format) and ``DIR/images/*.png``.
The same arguments give the same files.
"""

import argparse

from xtuner_rope.demo.llava_data import write_llava_data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/tiny_llava", help="output directory")
    p.add_argument("--images", type=int, default=12, help="image dialogues")
    p.add_argument("--text", type=int, default=12, help="text-only dialogues")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    path = write_llava_data(args.out, n_images=args.images, n_text=args.text, seed=args.seed)
    print(f"{args.images} image + {args.text} text dialogues written to {path}")


if __name__ == "__main__":
    main()
