"""Build a tiny checkpoint of any supported family (tokenizer + seeded weights), offline.

    python tools/make_tiny.py --family mistral --out models/tiny-mistral

Families: internlm2, llama, qwen2, mistral, phi3, mixtral, qwen2_moe, gemma, cohere (2 layers,
hidden 64, GQA 4/2 heads, each family's quirks: MoE experts, Gemma's MQA; vocabulary of 1024
byte-level BPE tokens trained on the package's sample dialogues), and clip (a CLIP vision
tower with its image processor, for XTuner's LLaVA configs: 2 layers, hidden 32, 56x56 images,
16 image tokens), and internvl2 (a tiny InternVL checkpoint around the tiny LLM of --llm:
InternLM2 with remote code or Phi-3; 112 px tiles, 16 tokens per tile). Works from any directory; the same arguments give the same files.
"""

import argparse
import time

from xtuner_rope.demo.tiny import FAMILIES, save_tiny
from xtuner_rope.demo.tiny_clip import save_tiny_clip
from xtuner_rope.demo.tiny_internvl import save_tiny_internvl


def parser(family: str | None = None) -> argparse.ArgumentParser:
    """The command line; ``family`` fixes the family (``make_tiny_internlm2.py``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if family is None:
        p.add_argument(
            "--family", required=True, choices=(*FAMILIES, "clip", "internvl2"), help="model family"
        )
        p.add_argument("--llm", default=None, help="internvl2: the tiny LLM checkpoint it wraps")
    p.add_argument(
        "--out",
        default=f"models/tiny-{family}" if family else None,
        required=family is None,
        help="checkpoint directory",
    )
    p.add_argument(
        "--data",
        default=None,
        help="OpenAI-messages JSONL that trains the tokenizer (default: the "
        "package's sample dialogues, the bytes of data/short_dialogues.jsonl)",
    )
    p.add_argument("--seed", type=int, default=0, help="weight-initialisation seed")
    p.add_argument("--vocab-size", type=int, default=1024)
    return p


def main(family: str | None = None) -> None:
    args = parser(family).parse_args()
    family = family or args.family
    start = time.perf_counter()
    if family == "clip":
        out = save_tiny_clip(args.out, seed=args.seed)
    elif family == "internvl2":
        if not args.llm:
            raise SystemExit("make_tiny: --family internvl2 needs --llm LLM_DIR (internlm2/phi3)")
        out = save_tiny_internvl(args.llm, args.out, seed=args.seed)
    else:
        out = save_tiny(args.out, family, args.data, seed=args.seed, vocab_size=args.vocab_size)
    print(f"tiny {family} written to {out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
