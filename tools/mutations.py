"""Turn each guarantee off in a scratch copy and run the CI tests mapped to it.

The map is ``tests/support/guarantees.py``; ``tests/test_guarantees.py`` runs the same check in
CI. Each line printed says which mapped tests failed (all must) with the guarantee off.

Usage:
    python tools/mutations.py                       # every guarantee, its mapped tests
    python tools/mutations.py --name atomic-write   # one
    python tools/mutations.py --name rng-restore --find tests/hooks/test_random_state.py
        # which tests of these files fail with it off (to extend the map)
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from guarantees import GUARANTEES, by_name, run_mutation  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", action="append", help="a guarantee's name (repeatable)")
    parser.add_argument("--find", nargs="+", help="test files or node ids to run instead")
    args = parser.parse_args()
    chosen = [by_name(n) for n in args.name] if args.name else list(GUARANTEES)
    status = 0
    for guarantee in chosen:
        failed, out = run_mutation(guarantee, args.find)
        missed = [] if args.find else sorted(set(guarantee.tests) - failed)
        print(f"{guarantee.name}: {len(failed)} failed with it off")
        for test in sorted(failed):
            print(f"  FAILED {test}")
        if missed or (args.find is None and not guarantee.tests):
            status = 1
            print(f"  NOT CAUGHT: {missed or 'no test mapped'}\n{out[-2000:]}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
