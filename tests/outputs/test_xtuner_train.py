"""`xtuner-rope train`: the child `xtuner train` starts, with that child's exit status.

Here the launch itself, for every launcher: XTuner's real entry point (`xtuner.entry_point.cli`,
what the `xtuner` command runs) and ours are each run with `python` and `torchrun` on PATH
replaced by a recorder that writes its command line and exits 3; both must start the same
command and only ours may say 3. Real training runs through `xtuner-rope train` (a success, a
crash, a refusal, a non-finite-loss stop) are in tests/integration/test_e2e.py,
tests/integration/test_remote_code_refusal.py and tests/hooks/test_monitor.py.
"""

from __future__ import annotations

import os
import stat
import sys

import pytest

from xtuner_rope.cli import main
from xtuner_rope.outputs.xtuner_train import run_xtuner_train, train_script

RECORDER = '#!/bin/sh\nprintf "%s\\n" "$(basename "$0")" "$@" > "$XTR_RECORD"\nexit 3\n'
ARGS = [
    "cfg.py",
    "--work-dir",
    "work dir",
    "--deepspeed",
    "deepspeed_zero2",
    "--resume",
    "work/iter_10.pth",
    "--cfg-options",
    "train_cfg.max_iters=10",
    "model.llm.attn_implementation=sdpa",
]
LAUNCHES = {  # id -> (extra arguments, launcher environment)
    "one process": ([], {}),
    "pytorch, NPROC_PER_NODE=2": (["--launcher", "pytorch"], {"NPROC_PER_NODE": "2"}),
    "two nodes": ([], {"NNODES": "2", "NODE_RANK": "1", "ADDR": "10.1.2.3", "NPROC_PER_NODE": "2"}),
    "slurm": (["--launcher", "slurm"], {"NPROC_PER_NODE": "4"}),
}
LAUNCH_ENV = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "ADDR", "PORT")


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    """`python` and `torchrun` first on PATH: record the command line, exit 3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "torchrun"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for var in LAUNCH_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PORT", "29611")  # else each picks its own random port
    record = tmp_path / "record"

    def launched(run) -> tuple[object, list[str]]:
        monkeypatch.setenv("XTR_RECORD", str(record))
        record.unlink(missing_ok=True)
        status = run()
        return status, record.read_text().splitlines()

    return launched


@pytest.mark.parametrize("launch", LAUNCHES, ids=list(LAUNCHES))
def test_same_command_as_xtuner_train_and_its_status(recorder, monkeypatch, launch):
    from xtuner.entry_point import cli as xtuner_cli

    extra, env = LAUNCHES[launch]
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    argv = [*ARGS, *extra]
    monkeypatch.setattr(sys, "argv", ["xtuner", "train", *argv])
    theirs, their_command = recorder(xtuner_cli)
    ours, our_command = recorder(lambda: main(["train", *argv]))
    assert our_command == their_command
    assert their_command[1 + their_command.index(train_script()) :][: len(argv)] == argv
    torchrun = launch in ("pytorch, NPROC_PER_NODE=2", "two nodes")
    assert their_command[0] == ("torchrun" if torchrun else "python")
    assert theirs is None  # `xtuner train` drops the status: its CLI returns nothing, exit 0
    assert ours == 3


def test_bad_launcher_environment_is_named(monkeypatch, capsys):
    monkeypatch.setenv("NPROC_PER_NODE", "two")
    assert run_xtuner_train(["cfg.py"]) == 2
    assert "NPROC_PER_NODE='two': expected integers" in capsys.readouterr().out


def test_signal_death_is_reported_as_a_shell_does(recorder, tmp_path, monkeypatch):
    killer = tmp_path / "bin" / "python"
    killer.write_text("#!/bin/sh\nkill -TERM $$\n")
    assert run_xtuner_train(["cfg.py"]) == 128 + 15


def test_parser_answer_is_xtuners_help_and_usage_errors_only(tmp_path, capsys):
    """XTuner's own `parse_args`, read from train.py: help 0, usage error 2, else the child's."""
    from xtuner_rope.outputs.xtuner_train import parser_answer

    assert parser_answer(["cfg.py", "--cfg-options", "a=1", "--launcher", "pytorch"]) is None
    assert parser_answer(["-h"]) == 0
    assert "usage: train.py" in capsys.readouterr().out
    assert parser_answer(["cfg.py", "--seed", "x"]) == 2
    assert "argument --seed: invalid int value: 'x'" in capsys.readouterr().err
    other = tmp_path / "train.py"
    other.write_text("import torch\n\ndef main():\n    pass\n")  # no parse_args: the child decides
    assert parser_answer(["-h"], script=str(other)) is None
