"""Regenerate the committed preference pairs of the tiny DPO and reward recipes.

Usage:
    python tools/make_preference_data.py --src data/short_dialogues.jsonl \
        --out data/preference_pairs.jsonl --n 300
"""

import argparse
import json
import sys
from pathlib import Path

# Run as a script (`python tools/...py`): the repository root is what imports `tools`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.sample_data.preference_pairs import preference_pairs, write_pairs  # noqa: E402


def parse_args():
    """Parse the command line: source dialogues, output path, number of pairs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default="data/short_dialogues.jsonl", help="sample dialogues")
    parser.add_argument("--out", default="data/preference_pairs.jsonl", help="output JSONL")
    parser.add_argument("--n", type=int, default=300, help="number of pairs")
    return parser.parse_args()


def main():
    """Build the pairs from the first dialogues, write them, print the count and size."""
    args = parse_args()
    with open(args.src, encoding="utf-8") as f:
        dialogues = [json.loads(line) for line in f]
    pairs = preference_pairs(dialogues, args.n)
    write_pairs(pairs, args.out)
    with open(args.out, "rb") as f:
        size = len(f.read())
    print(f"wrote {len(pairs)} pairs to {args.out} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
