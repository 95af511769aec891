"""The ``xtuner-rope`` command (console script; also ``python -m xtuner_rope.cli``).

    xtuner-rope doctor CONFIG [--out DIR] [--batches N] [--cfg-options k=v ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from mmengine.config import DictAction

    parser = argparse.ArgumentParser(prog="xtuner-rope", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser(
        "doctor", help="check a config's training data before training",
        description="Build the config's train dataset as `xtuner train` does and report what "
                    "the plugin will see: lengths, bad samples, the collate plan, settings. "
                    "Exit 1 when training would fail or be silently wrong.")
    doctor.add_argument("config", help="XTuner config file")
    doctor.add_argument("--out", help="output folder for report.json and lengths.png "
                                      "(default: work_dirs/doctor/<config stem>)")
    doctor.add_argument("--batches", type=int, default=200,
                        help="sampler batches to collate (default: 200)")
    doctor.add_argument("--cfg-options", nargs="+", action=DictAction, default=None,
                        help="override config settings, key=value (as xtuner train)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    from .doctor import diagnose
    from .doctor_report import format_summary, write_outputs

    report, lengths = diagnose(args.config, args.cfg_options, batches=args.batches)
    out = args.out or Path("work_dirs") / "doctor" / Path(args.config).stem
    paths = write_outputs(report, lengths, out)
    print(format_summary(report))
    print(f"wrote {paths['report']} and {paths['lengths']}")
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
