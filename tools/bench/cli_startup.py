"""Time each `xtuner-rope` command as a whole process, beside `python -c pass` and `xtuner list-cfg`.

Every command runs start to end in a fresh process (interpreter start-up, imports, the answer),
`--repeats` times interleaved with the baselines; the median is printed in seconds and as ratios
to `python -c pass` (the floor) and to `xtuner list-cfg` (XTuner's own fastest command), e.g.:

    xtuner-rope --help                       0.05 s    1.9x python   0.02x list-cfg

The console scripts are the ones beside this Python (`xtuner-rope`, `xtuner`), run with this
process's environment: set `PYTHONPATH` to time a checkout other than the installed one.

Usage:
    python tools/bench/cli_startup.py [--repeats 3] [--quick] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

BIN = Path(sys.executable).parent
CONFIG = "configs/internlm2_chat_1_8b_qlora_short_dialogues.py"  # an existing config: a usage error must not be about the file
BASELINES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "xtuner list-cfg": [str(BIN / "xtuner"), "list-cfg"],
}
# What users type; the heavy ones last (XTuner's own help, the plugin's activation).
COMMANDS = {
    "xtuner-rope --help": ["--help"],
    "xtuner-rope doctor --help": ["doctor", "--help"],
    "xtuner-rope check --help": ["check", "--help"],
    "xtuner-rope convert --help": ["convert", "--help"],
    "xtuner-rope no-such-command": ["no-such-command"],
    "xtuner-rope doctor (no config)": ["doctor"],
    "xtuner-rope doctor no/such.py": ["doctor", "no/such.py"],
    "xtuner-rope doctor CFG --batchs 3": ["doctor", CONFIG, "--batchs", "3"],
    "xtuner-rope train --help (XTuner's)": ["train", "--help"],
    "xtuner-rope train (no config)": ["train"],
    "xtuner-rope convert pth_to_hf --help": ["convert", "pth_to_hf", "--help"],
}
HEAVY = {
    "python -c 'import xtuner_rope'": [sys.executable, "-c", "import xtuner_rope"],
    "xtuner_rope.activate()": [sys.executable, "-c", "import xtuner_rope; xtuner_rope.activate()"],
    "xtuner-rope chat --help (XTuner's)": [str(BIN / "xtuner-rope"), "chat", "--help"],
}


def wall_time(command: list[str]) -> float:
    """Seconds from start to exit of ``command``, its output discarded."""
    start = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per command (default: 3)")
    parser.add_argument("--quick", action="store_true", help="leave out the heavy commands")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="time only commands whose name contains one of these",
    )
    args = parser.parse_args()
    ours = {name: [str(BIN / "xtuner-rope"), *argv] for name, argv in COMMANDS.items()}
    if not args.quick:
        ours |= HEAVY
    if args.only:
        ours = {name: cmd for name, cmd in ours.items() if any(o in name for o in args.only)}
    commands = BASELINES | ours
    times: dict[str, list[float]] = {name: [] for name in commands}
    runs = [(round_, name) for round_ in range(args.repeats) for name in commands]
    for _, name in tqdm(runs, desc="runs", leave=False):  # interleaved: load hits all alike
        times[name].append(wall_time(commands[name]))
    median = {name: statistics.median(values) for name, values in times.items()}
    floor, xtuner = median["python -c pass"], median["xtuner list-cfg"]
    print(
        f"median of {args.repeats} whole-process runs, {os.cpu_count()} CPUs, "
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}"
    )
    for name, seconds in median.items():
        print(
            f"{name:<40} {seconds:6.2f} s  {seconds / floor:6.1f}x python  "
            f"{seconds / xtuner:5.2f}x list-cfg"
        )


if __name__ == "__main__":
    main()
