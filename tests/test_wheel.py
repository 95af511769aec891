"""The wheel holds the package's code, its commands and its data, and none of the maintainer's tools.

Built as a user's ``pip install`` builds it (``pip wheel --no-deps --no-build-isolation``, a
few seconds) from a copy of the packaging files and ``xtuner_rope/`` (building in the checkout
would leave ``build/`` behind), then read as the zip it is: every module of the package is in
it and nothing else of the repository (``tools/``: the config zoo and the sample-data
generator; ``tests/``); every data file the package reads at run time is in it (the sample
dialogues the tiny checkpoints' tokenizer is trained on: ``xtuner_rope.demo.sample_dialogues``
opens them beside itself, the same folder in a wheel's install and an editable one).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "xtuner_rope"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(
        PACKAGE, src / "xtuner_rope", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*cmd, "-w", str(out), "-q"], capture_output=True, text=True, timeout=600, cwd=src
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("xtuner_rope-*.whl")
    return zipfile.ZipFile(path)


def _package_files() -> set[str]:
    return {
        p.relative_to(REPO).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_the_wheel_is_the_package_and_nothing_else(wheel):
    names = {n for n in wheel.namelist() if ".dist-info/" not in n}
    assert names == _package_files(), (
        "in the wheel, not the package (a tool or test packaged?): "
        f"{sorted(names - _package_files())}; in the package, not the wheel (add it to "
        f"setup.cfg [options.package_data]): {sorted(_package_files() - names)}"
    )
    assert not [n for n in names if n.split("/")[0] in {"tools", "tests"}]


def test_the_wheel_ships_the_sample_dialogues_the_repository_links_to(wheel):
    shipped = wheel.read("xtuner_rope/demo/short_dialogues.jsonl")
    assert shipped == (REPO / "data" / "short_dialogues.jsonl").read_bytes()
    assert shipped.count(b"\n") == 2400


def test_the_wheel_installs_the_command(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "xtuner-rope = xtuner_rope.cli:main" in wheel.read(entry_points).decode()
