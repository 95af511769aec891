"""Regenerate the committed sample of short chat dialogues.

Usage:
    python tools/make_sample_data.py --out data/short_dialogues.jsonl --n 2400 --seed 0
"""

import argparse
import statistics

from xtuner_rope.demo.sample_data import dialogue_words, generate_dialogues, write_jsonl


def parse_args():
    """Parse the command line: output path, number of dialogues, seed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/short_dialogues.jsonl", help="output JSONL path")
    parser.add_argument("--n", type=int, default=2400, help="number of dialogues")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    return parser.parse_args()


def main():
    """Generate, write, and print the count and a per-dialogue word-length summary."""
    args = parse_args()
    dialogues = generate_dialogues(n=args.n, seed=args.seed)
    write_jsonl(dialogues, args.out)
    words = [dialogue_words(d) for d in dialogues]
    turns = [sum(m["role"] == "user" for m in d["messages"]) for d in dialogues]
    single = turns.count(1)
    print(f"wrote {len(dialogues)} dialogues to {args.out}")
    print(f"turns: {single} single-turn, {len(turns) - single} multi-turn (max {max(turns)})")
    print(
        f"words per dialogue: min {min(words)}, mean {statistics.mean(words):.1f}, "
        f"median {statistics.median(words):g}, max {max(words)}"
    )


if __name__ == "__main__":
    main()
