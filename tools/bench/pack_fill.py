"""Whole-dialogue packing against XTuner's cut: fill, rows and dialogues cut, and plan time.

Plans only (``xtuner_rope.data.pack_plans``: the lengths decide everything), on length
distributions drawn with a fixed seed and truncated at ``max_length`` as XTuner's
``encode_fn`` truncates:

- ``alpaca``: short single-turn instructions, log-normal around 180 tokens (alpaca-like with
  a real tokenizer: median ~150, a tail past 1,000);
- ``multi-turn``: long conversations, log-normal around 750 tokens (oasst1 / MOSS-like:
  600-1,000 on average);
- ``uniform``: 8-100 tokens (the synthetic dialogues of ``tools/bench/pack_dataset.py``).

Printed per set: rows of whole-dialogue packing and of XTuner's cut of the same stream (its
leftover kept) and their ratio, the fill (real tokens / row slots) of each, the dialogues
XTuner's cut splits, and the seconds to plan the whole-dialogue rows.

Usage:
    python tools/bench/pack_fill.py [--dialogues 100000] [--max-length 2048]
"""

import argparse
import time

import numpy as np

from xtuner_rope.data.pack_plans import cut_dialogues, cut_plan, whole_plan


def lengths_of(kind: str, n: int, max_length: int, seed: int = 0) -> np.ndarray:
    """``[n]`` dialogue lengths of one distribution, truncated at ``max_length``."""
    rng = np.random.default_rng(seed)
    if kind == "alpaca":
        raw = rng.lognormal(np.log(180), 0.75, n)
    elif kind == "multi-turn":
        raw = rng.lognormal(np.log(750), 0.6, n)
    elif kind == "uniform":
        raw = rng.integers(8, 101, n)
    else:
        raise ValueError(f"--sets: unknown set {kind!r}; choose alpaca, multi-turn, uniform.")
    return np.clip(raw.astype(np.int64), 8, max_length)


def figures(lengths: np.ndarray, max_length: int) -> dict:
    """Rows, fill and cut dialogues of both plans, and the whole plan's time."""
    start = time.perf_counter()
    _, _, row_pieces = whole_plan(lengths, max_length)
    seconds = time.perf_counter() - start
    cuts = cut_plan(lengths, max_length)
    whole_rows, cut_rows = len(row_pieces) - 1, len(cuts) - 1
    tokens = int(lengths.sum())
    return {
        "dialogues": len(lengths),
        "mean_length": float(lengths.mean()),
        "rows_whole": whole_rows,
        "rows_cut": cut_rows,
        "rows_ratio": whole_rows / cut_rows,
        "fill_whole": tokens / (whole_rows * max_length),
        "fill_cut": tokens / (cut_rows * max_length),
        "cut_by_xtuner": cut_dialogues(lengths, cuts),
        "plan_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialogues", type=int, default=100_000)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--sets", nargs="+", default=["alpaca", "multi-turn", "uniform"])
    args = parser.parse_args()
    for kind in args.sets:
        f = figures(lengths_of(kind, args.dialogues, args.max_length), args.max_length)
        print(
            f"{kind:10s} {f['dialogues']} dialogues, mean {f['mean_length']:.0f} tokens, "
            f"max_length {args.max_length}: rows whole {f['rows_whole']} / cut "
            f"{f['rows_cut']} = {f['rows_ratio']:.4f}x; fill whole {f['fill_whole']:.2%}, cut "
            f"{f['fill_cut']:.2%}; XTuner's cut splits {f['cut_by_xtuner']} dialogues "
            f"({f['cut_by_xtuner'] / f['dialogues']:.1%}); whole plan {f['plan_seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
