"""Replay a batch saved by NonFiniteTripwireHook and name the first layer and document that
produced a NaN/inf.

Usage (from the repository root, as for `xtuner train`):
    python tools/replay_batch.py WORK_DIR/nonfinite_iterK.pt --config CONFIG [--checkpoint CKPT]

Without --checkpoint the weights saved next to the batch are used: the model exactly as the
failing batch saw it (the tripwire fires before the optimizer step).
"""

import argparse
import sys

from mmengine.config import DictAction

from xtuner_rope.outputs.replay import build_run_model, load_record, replay


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("batch_file", help="the nonfinite_iter<k>.pt named by the error")
    parser.add_argument("--config", required=True, help="the training config")
    parser.add_argument(
        "--checkpoint", help="MMEngine checkpoint to load instead of the saved weights"
    )
    parser.add_argument(
        "--cfg-options",
        nargs="+",
        action=DictAction,
        help="config overrides, as given to xtuner train",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    record = load_record(args.batch_file)
    print(
        f"batch of iteration {record['iteration']} (seed {record['seed']}, rank "
        f"{record['rank']}): non-finite {record['quantity']} = {record['value']}; "
        f"input_ids {list(record['data']['input_ids'].shape)}"
    )
    if record.get("nonfinite_grads"):
        print(f"parameters with non-finite gradients: {record['nonfinite_grads']}")
    model = build_run_model(args.config, record, args.checkpoint, args.cfg_options)
    finding = replay(model, record)
    if finding is None:
        print("replay: the batch runs finite forward and backward with these weights")
        return 1
    print("replay: " + finding.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
