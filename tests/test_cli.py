"""The command line's face: `--help` and usage errors without torch, no third-party banner.

Each case runs `xtuner-rope` in a fresh interpreter (the console script's own entry,
`xtuner_rope.cli.main`) and reports which heavy libraries the run imported: the answer must
come from the standard library alone. How long it takes is measured by `tools/bench/cli_startup.py`
(`docs/measurements.md`), not asserted here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mmengine", "xtuner", "deepspeed", "bitsandbytes", "transformers", "datasets")
TOOLS = ("check", "capture", "doctor", "outputs")
BANNER_WORDS = ("bitsandbytes", "Setting accelerator", "DeepSpeed")
# Runs the console script's entry with ARGV, then prints the heavy modules it imported.
RUN_CLI = (
    "import json, sys\n"
    "from xtuner_rope.cli import main\n"
    "try:\n"
    "    code = main(json.loads(sys.argv[1]))\n"
    "except SystemExit as stop:\n"
    "    code = stop.code\n"
    "heavy = [name for name in json.loads(sys.argv[2]) if name in sys.modules]\n"
    "print('RESULT', json.dumps({'code': code, 'heavy': heavy}))\n"
)


def _env() -> dict[str, str]:
    """This checkout first on the path, as the tests themselves import it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_cli(argv: list[str]) -> tuple[dict, str]:
    """``xtuner-rope ARGV`` in a fresh interpreter.

    Returns:
        ``{"code": exit status, "heavy": heavy modules imported}`` and the rest of the output
        (stdout and stderr).
    """
    proc = subprocess.run(
        [sys.executable, "-c", RUN_CLI, json.dumps(argv), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=REPO,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    result = [line for line in lines if line.startswith("RESULT ")]
    assert result, proc.stdout + proc.stderr
    return json.loads(result[0][len("RESULT ") :]), "\n".join(
        line for line in lines if not line.startswith("RESULT ")
    )


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["doctor", "--help"], ["check", "--help"], ["convert", "--help"]],
    ids=" ".join,
)
def test_help_imports_no_heavy_library(argv):
    result, output = run_cli(argv)
    assert result == {"code": 0, "heavy": []}, output
    assert "usage: xtuner-rope" in output


def test_train_help_is_xtuners_without_its_imports():
    """`train -h` shows XTuner's own train.py help (read from that file), torch not imported."""
    result, output = run_cli(["train", "--help"])
    assert result == {"code": 0, "heavy": []}, output
    assert "usage: train.py" in output and "--cfg-options" in output


def test_convert_pth_to_hf_help_is_xtuners_without_its_imports():
    result, output = run_cli(["convert", "pth_to_hf", "--help"])
    assert result == {"code": 0, "heavy": []}, output
    assert "usage: xtuner convert pth_to_hf" in output


def test_python_dash_m_cli_help_imports_no_torch():
    """`python -m xtuner_rope.cli` imports the package first, by its own name: still inert."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "xtuner_rope.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=REPO,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert proc.returncode == 0 and "usage: xtuner-rope" in proc.stdout, proc.stderr[-2000:]
    assert "xtuner_rope" in imported and not imported & set(HEAVY)


def test_help_prints_no_third_party_banner():
    _, output = run_cli(["--help"])
    banners = [line for line in output.splitlines() if any(w in line for w in BANNER_WORDS)]
    assert not banners, banners


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such-command"], "invalid choice: 'no-such-command'"),
        (["doctor"], "the following arguments are required: config"),
        (["check", "no/such/config.py"], "config file not found: no/such/config.py"),
        (["doctor", "no/such/config.py"], "config file not found: no/such/config.py"),
        (["doctor", "README.md", "--batches", "many"], "argument --batches: invalid int"),
        (["doctor", "README.md", "--cfg-options", "a"], "expected key=value, got a"),
        (["check", "README.md", "--dtype", "fp8"], "argument --dtype: invalid choice"),
        (["doctor", "README.md", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["convert"], "the following arguments are required: tool"),
        (["train"], "train.py: error: the following arguments are required: config"),
        (["convert", "pth_to_hf", "c.py"], "required: pth_model, save_dir"),
        (["train", "c.py", "--launcher", "foo"], "argument --launcher: invalid choice: 'foo'"),
    ],
)
def test_a_usage_error_exits_2_without_heavy_libraries(argv, message):
    result, output = run_cli(argv)
    assert result == {"code": 2, "heavy": []}, output
    assert message in output


def test_cfg_options_mean_what_mmengine_dict_action_makes_of_them():
    from mmengine.config import DictAction

    from xtuner_rope.cli import build_parser, cfg_options

    argv = ["a=1", "b=[1,2]", "c=x,y", "d=(1,(2,3))", "e=None", "a=2", "f.g=True"]
    reference = argparse.ArgumentParser()
    reference.add_argument("--cfg-options", nargs="+", action=DictAction)
    expected = reference.parse_args(["--cfg-options", *argv[:3], "--cfg-options", *argv[3:]])
    args, _ = build_parser().parse_known_args(
        ["doctor", "README.md", "--cfg-options", *argv[:3], "--cfg-options", *argv[3:]]
    )
    assert cfg_options(args.cfg_options) == expected.cfg_options
    assert cfg_options(None) is None


def test_the_import_banners_are_dropped_and_nothing_else():
    from xtuner_rope.cli import BANNERS, DropBanner

    for name, start in BANNERS.items():
        drop = DropBanner(start)
        make = logging.getLogger(name).makeRecord
        assert not drop.filter(make(name, logging.WARNING, "", 0, start + " more.", (), None))
        assert drop.filter(make(name, logging.WARNING, "", 0, "Something else.", (), None))


def test_a_subcommand_activates_the_plugin_without_the_banners():
    """What doctor/check/convert/chat run first: the patches and registries, banners left out."""
    code = (
        "import sys\n"
        "from xtuner_rope.cli import activate_quietly\n"
        "assert 'torch' not in sys.modules\n"
        "activate_quietly()\n"
        "import xtuner_rope\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "from mmengine.registry import HOOKS\n"
        "assert 'internlm2' in CONFIG_MAPPING and HOOKS.get('ValidatedRoPEHook') is not None\n"
        "print('activated', xtuner_rope._activated)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=_env()
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "activated True" in output, output[-3000:]
    banners = [line for line in output.splitlines() if any(w in line for w in BANNER_WORDS[:2])]
    assert not banners, banners


def test_import_xtuner_rope_loads_the_start_up_and_no_tool():
    """A config's `from xtuner_rope import ...`: reading a public name activates the plugin (the
    import alone does not), and loads every public name and none of the tools."""
    code = (
        "import json, sys, xtuner_rope\n"
        "before = [xtuner_rope._activated, 'xtuner_rope.compat' in sys.modules]\n"
        "missing = [n for n in xtuner_rope.__all__ if getattr(xtuner_rope, n, None) is None]\n"
        "tools = sorted(m for m in sys.modules if m.split('.')[:2][-1] in json.loads(sys.argv[1])"
        " and m.startswith('xtuner_rope.'))\n"
        "print('RESULT', json.dumps({'missing': missing, 'tools': tools,"
        " 'before': before, 'activated': xtuner_rope._activated}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(TOOLS)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, proc.stderr[-3000:]
    assert json.loads(result[0][len("RESULT ") :]) == {
        "missing": [],
        "tools": [],
        "before": [False, False],
        "activated": True,
    }
