"""Regenerate the committed sample of short chat dialogues.

Usage:
    python tools/make_sample_data.py --out xtuner_rope/demo/short_dialogues.jsonl --n 2400 --seed 0

The file is the package's data (``xtuner_rope.demo.sample_dialogues`` reads it; the wheel
ships it); ``data/short_dialogues.jsonl`` is a link to it.
"""

import argparse
import statistics
import sys
from pathlib import Path

# Run as a script (`python tools/...py`): the repository root is what imports `tools`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.sample_data import dialogue_words, generate_dialogues, write_jsonl  # noqa: E402


def parse_args():
    """Parse the command line: output path, number of dialogues, seed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="xtuner_rope/demo/short_dialogues.jsonl", help="output JSONL path"
    )
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
