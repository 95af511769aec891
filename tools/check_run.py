"""Print the loss curve and checkpoint of an `xtuner train` run; exit 1 if it did not train.

python tools/check_run.py work_dirs/tiny_internlm2_short_dialogues --min-iters 150
"""

import argparse
import sys
from pathlib import Path

from xtuner_rope.demo.runlog import check_run
from xtuner_rope.evaluation.hook import CURVES_FILE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work_dir")
    parser.add_argument("--min-iters", type=int, default=1)
    args = parser.parse_args()
    try:
        run = check_run(args.work_dir, args.min_iters)
    except RuntimeError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    curve = "  ".join(f"{i}:{loss:.3f}" for i, loss in zip(run.iters, run.losses))
    print(f"loss by iteration: {curve}")
    print(f"loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}; checkpoint: {run.checkpoint}")
    curves = Path(args.work_dir) / CURVES_FILE
    if curves.is_file():
        print(f"training and held-out loss curves: {curves.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
