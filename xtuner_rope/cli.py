"""The ``xtuner-rope`` command (console script; also ``python -m xtuner_rope.cli``).

xtuner-rope train CONFIG [...]   (xtuner train, same arguments and launchers, real exit status)
xtuner-rope doctor CONFIG [--out DIR] [--work-dir DIR] [--batches N] [--cfg-options k=v ...] [--deepspeed X] [--quiet]
xtuner-rope check CONFIG [--out DIR] [--batches N] [--dtype D] [--cfg-options k=v ...]
xtuner-rope convert pth_to_hf CONFIG PTH SAVE_DIR [--dtype bf16|fp16|fp32] [...]   (XTuner's tools, plugin loaded)
xtuner-rope convert merge LLM ADAPTER SAVE_DIR [--dtype bf16|fp16|fp32] [...]
xtuner-rope chat MODEL [...]
"""

# This module is the command line's face and imports the standard library only: `--help`, a
# subcommand's `--help` and every usage error answer without torch, MMEngine, XTuner, DeepSpeed
# or bitsandbytes (issue 42: importing them took 8.8 s). `xtuner_rope/__init__.py` does not
# activate the plugin when this module is what was imported; each subcommand activates it
# (`activate_quietly`) and imports its implementation only once its arguments have parsed.

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# Import-time lines of libraries the subcommands load, kept off the user's first screen:
# logger name -> the start of the message. Neither is about the user's job: bitsandbytes 0.45
# says its CPU build has no GPU kernels, DeepSpeed 0.19 that it found no accelerator.
BANNERS = {
    "bitsandbytes.cextension": "The installed version of bitsandbytes was compiled without GPU",
    "DeepSpeed": "Setting accelerator to CPU",
}


class _KeyValues(argparse.Action):
    """``--cfg-options k=v ...`` checked and kept as text; :func:`cfg_options` parses them with
    MMEngine's ``DictAction`` once the subcommand runs (importing MMEngine takes seconds)."""

    def __call__(self, parser, namespace, values, option_string=None):
        bad = [value for value in values if "=" not in value]
        if bad:
            raise argparse.ArgumentError(self, f"expected key=value, got {' '.join(bad)}")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *values])


def cfg_options(pairs: list[str] | None) -> dict | None:
    """``--cfg-options`` (the texts :class:`_KeyValues` kept) as ``DictAction`` parses them for
    ``xtuner train``: ``{key: value}``, or None when the option was not given."""
    if pairs is None:
        return None
    from mmengine.config import DictAction

    namespace = argparse.Namespace()
    DictAction(option_strings=["--cfg-options"], dest="cfg_options")(None, namespace, pairs)
    return namespace.cfg_options


class DropBanner(logging.Filter):
    """Drops one import-time message of a third-party logger (see :data:`BANNERS`)."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def activate_quietly() -> None:
    """Activate the plugin with :data:`BANNERS` left out of the output (filters on the named
    loggers while the stack is imported, removed after)."""
    import xtuner_rope

    filters = {name: DropBanner(start) for name, start in BANNERS.items()}
    for name, drop in filters.items():
        logging.getLogger(name).addFilter(drop)
    try:
        xtuner_rope.activate()
    finally:
        for name, drop in filters.items():
            logging.getLogger(name).removeFilter(drop)


def _existing_config(path: str) -> str:
    """``type=`` of a CONFIG argument: a usage error (exit 2) when no such file exists."""
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"config file not found: {path}")
    return path


def _add_config_arguments(command: argparse.ArgumentParser, outputs: str) -> None:
    """CONFIG, ``--out`` and ``--cfg-options``, as ``doctor`` and ``check`` take them."""
    command.add_argument("config", type=_existing_config, help="XTuner config file")
    command.add_argument(
        "--out",
        help=f"output folder for {outputs} (default: work_dirs/{command.prog.split()[-1]}/"
        "<config stem>)",
    )
    command.add_argument(
        "--cfg-options",
        nargs="+",
        action=_KeyValues,
        default=None,
        help="override config settings, key=value (as xtuner train)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xtuner-rope", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "train",
        add_help=False,
        help="xtuner train, with an exit status that says whether training finished",
        description="XTuner's `xtuner train`, same arguments and launchers (`-h` shows "
        "XTuner's); exit status non-zero when training did not finish.",
    )
    doctor = commands.add_parser(
        "doctor",
        help="check a config's training data before training",
        description="Build the config's train dataset as `xtuner train` does and report what "
        "the plugin will see: lengths, bad samples, the collate plan, settings. "
        "Exit 1 when training would fail or be silently wrong.",
    )
    _add_config_arguments(doctor, "report.json and lengths.png")
    doctor.add_argument(
        "--work-dir",
        help="the run's --work-dir, where checkpoint size and free space are judged "
        "(default: as xtuner train: the config's work_dir, else work_dirs/<config stem>)",
    )
    doctor.add_argument(
        "--batches", type=int, default=200, help="sampler batches to collate (default: 200)"
    )
    doctor.add_argument(
        "--deepspeed",
        default=None,
        help="the DeepSpeed config the run will get (as xtuner train: a json or "
        "one of XTuner's names, e.g. deepspeed_zero2)",
    )
    doctor.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (the doctor's steps and bars, the datasets library's bars)",
    )
    _add_check(commands)
    _add_xtuner_tools(commands)
    return parser


def _add_check(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "check",
        help="prove document isolation on the config's own model and data",
        description="Start the config as `xtuner train` does, build its model and first packed "
        "batches, and compare each packed document with the same document alone "
        "(logits, loss, gradients) and patched with unpatched generation. "
        "Exit 1 when documents are not isolated or results differ.",
    )
    _add_config_arguments(check, "report.json and the runner's log")
    check.add_argument("--batches", type=int, default=1, help="batches to measure (default: 1)")
    check.add_argument(
        "--max-documents",
        type=int,
        default=8,
        help="documents per batch; rows are cut after them (default: 8)",
    )
    check.add_argument(
        "--new-tokens",
        type=int,
        default=8,
        help="greedy tokens generated from the first prompt (default: 8)",
    )
    check.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="override the training dtype (default: the config's on a GPU, float32 on CPU)",
    )


def _check(args: argparse.Namespace) -> int:
    """``xtuner-rope check``: measure document isolation, write the report; the exit status."""
    activate_quietly()
    from xtuner_rope.check import format_summary, run_check, write_report

    from .config.findings import ConfigConflict

    out = Path(args.out or Path("work_dirs") / "check" / Path(args.config).stem)
    try:
        report = run_check(
            args.config,
            cfg_options(args.cfg_options),
            batches=args.batches,
            work_dir=out,
            dtype=args.dtype,
            max_documents=args.max_documents,
            new_tokens=args.new_tokens,
        )
    except ConfigConflict as err:
        print(err)
        return 1
    path = write_report(report, out)
    print(format_summary(report))
    print(f"wrote {path}")
    return report["exit_code"]


def _add_xtuner_tools(commands: argparse._SubParsersAction) -> None:
    """`convert pth_to_hf`, `convert merge`, `chat`: XTuner's tools; their arguments pass on."""
    note = (
        "XTuner's `xtuner {}` run with xtuner-rope loaded (CPU patches, InternLM2 "
        "registration); same arguments (`-h` shows XTuner's), truthful exit status."
    )
    convert = commands.add_parser("convert", help="xtuner convert pth_to_hf / merge, plugin loaded")
    tools = convert.add_subparsers(dest="tool", required=True)
    for tool in ("pth_to_hf", "merge"):
        tools.add_parser(tool, add_help=False, description=note.format(f"convert {tool}"))
    from xtuner_rope.outputs.xtuner_tools import DTYPE_CHOICES, DTYPE_HELP  # standard library only

    for tool, note in DTYPE_HELP.items():
        tools.choices[tool].add_argument("--dtype", choices=DTYPE_CHOICES, help=note)
    commands.add_parser(
        "chat", add_help=False, help="xtuner chat, plugin loaded", description=note.format("chat")
    )


def _doctor(args: argparse.Namespace) -> int:
    """``xtuner-rope doctor``: diagnose the config's data, write the report; the exit status."""
    activate_quietly()
    from xtuner_rope.doctor.diagnose import diagnose
    from xtuner_rope.doctor.judge import exit_code
    from xtuner_rope.doctor.progress import datasets_bars
    from xtuner_rope.doctor.report import format_summary, write_outputs
    from xtuner_rope.doctor.verdict import launch_problems, refusal_when_data_fails

    from .config.findings import ConfigConflict
    from .config.launch import launched_with

    options = cfg_options(args.cfg_options)
    try:
        with (
            launched_with(args.deepspeed),
            refusal_when_data_fails(args.config, options),
            datasets_bars(not args.quiet),
        ):
            report, lengths = diagnose(
                args.config,
                options,
                batches=args.batches,
                progress=not args.quiet,
                work_dir=args.work_dir,
            )
    except ConfigConflict as err:  # the start-up refuses and the data could not be built
        print(err)
        return 1
    sp = (report.get("sequence_parallel") or {}).get("size", 1)
    report["problems"] += launch_problems(sp, args.deepspeed)  # xtuner train's own refusal
    report["exit_code"] = exit_code(report)
    out = args.out or Path("work_dirs") / "doctor" / Path(args.config).stem
    paths = write_outputs(report, lengths, out)
    print(format_summary(report))
    print(f"wrote {paths['report']} and {paths['lengths']}")
    return report["exit_code"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); the subcommand's exit status.
    Usage errors exit 2 through argparse (``SystemExit``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # every argument passes on to XTuner's train.py, untouched
        # Only a launcher here: the child's config loads the plugin, this process needs none.
        from xtuner_rope.outputs.xtuner_train import run_xtuner_train

        return run_xtuner_train(argv[1:])
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("convert", "chat"):
        from xtuner_rope.outputs.xtuner_tools import dtype_help, parser_answer, run_xtuner_tool

        command = (args.command, args.tool) if args.command == "convert" else (args.command,)
        answered = parser_answer(command, rest)  # `-h`, a usage error: the tool's own words
        if answered is None:
            activate_quietly()  # XTuner's tool runs in this process: the patches go first
            answered = run_xtuner_tool(command, rest, getattr(args, "dtype", None))
        if answered == 0 and command[0] == "convert" and {"-h", "--help"} & set(rest):
            print(dtype_help(command[1]))  # the option xtuner-rope adds
        return answered
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "check":
        return _check(args)
    return _doctor(args)


if __name__ == "__main__":
    sys.exit(main())
