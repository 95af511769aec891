"""Pack planning time: best-fit decreasing (``ops.pack_planner``) on dialogue lengths.

Times the planner on 16 dialogues (mean of ``--repeats`` calls, as collate-time packing plans
one batch) and on 1M lengths: realistic ones (8-100 tokens, ``max_length`` 2048) and
all-distinct ones (a permutation of 1..1M at ``max_length`` 1,000,000 and 2**62, the worst
case: no two equal lengths to place in bulk). Prints each time and its ratio to the target
(issue 50: 0.2 ms for 16 dialogues, 5 s for 1M at any ``max_length``).

Usage:
    python tools/bench/plan.py [--n 1000000] [--repeats 1000]
"""

import argparse
import time

import numpy as np

from xtuner_rope.ops.pack_planner import best_fit_decreasing


def seconds(lengths: np.ndarray, max_length: int, repeats: int = 1) -> tuple[float, int]:
    """Mean seconds of one plan, and its rows."""
    start = time.perf_counter()
    for _ in range(repeats):
        _, offsets = best_fit_decreasing(lengths, max_length)
    return (time.perf_counter() - start) / repeats, len(offsets) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    cases = [
        ("16 dialogues, 8-100 tokens, max_length 2048", rng.integers(8, 101, 16), 2048, 2e-4),
        (
            f"{args.n} dialogues, 8-100 tokens, max_length 2048",
            rng.integers(8, 101, args.n),
            2048,
            5,
        ),
        (f"{args.n} distinct lengths, max_length {args.n}", rng.permutation(args.n) + 1, args.n, 5),
        (f"{args.n} distinct lengths, max_length 2**62", rng.permutation(args.n) + 1, 2**62, 5),
    ]
    for name, lengths, max_length, target in cases:
        took, rows = seconds(lengths, max_length, args.repeats if len(lengths) < 1000 else 1)
        print(f"{name}: {took * 1e3:.3f} ms, {rows} rows ({took / target:.2f}x the target)")


if __name__ == "__main__":
    main()
