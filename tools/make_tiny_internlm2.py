"""Build the embedded tiny InternLM2 checkpoint (tokenizer + seeded weights), offline.

    python tools/make_tiny_internlm2.py --out models/tiny-internlm2
"""

import argparse
import time

from xtuner_rope.demo.tiny import save_tiny_internlm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/tiny-internlm2", help="checkpoint directory")
    parser.add_argument("--data", default="data/short_dialogues.jsonl",
                        help="OpenAI-messages JSONL that trains the tokenizer")
    parser.add_argument("--seed", type=int, default=0, help="weight-initialisation seed")
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args()
    start = time.perf_counter()
    out = save_tiny_internlm2(args.out, args.data, seed=args.seed, vocab_size=args.vocab_size)
    print(f"tiny InternLM2 written to {out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
