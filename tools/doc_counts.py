"""Counts of the code that the docs state (tests, configs, modules): check them, or rewrite them.

A count in a page is written between markers, ``<!-- count:NAME -->1,224<!-- /count -->`` (the
markers do not render), where NAME is one of:

- ``tests``: the test items of the whole suite (``pytest --collect-only``);
- ``fast-tests``: those ``make test-fast`` runs (not under ``tests/integration``, not ``slow``);
- ``tests:PATH``: the test items of one test file;
- ``modules`` / ``modules:FOLDER``: the ``.py`` files of ``xtuner_rope/`` (or of one folder);
- ``configs``: the recipes in ``configs/`` (``*.py``).

``python tools/doc_counts.py`` prints every stated count next to the code's and exits 1 on a
difference; ``--write`` rewrites the pages with the code's counts. ``tests/test_docs.py`` runs
the same comparison, so a count that drifts fails the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs")
MARKER = re.compile(r"<!-- count:(?P<name>[^ ]+) -->(?P<value>[\d,]+)<!-- /count -->")


def pages(repo: Path = REPO) -> list[Path]:
    """The README and every page of the docs site."""
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def stated(repo: Path = REPO) -> list[tuple[Path, str, int]]:
    """``(page, name, value)`` of every count marker in the pages."""
    found = []
    for page in pages(repo):
        for match in MARKER.finditer(page.read_text(encoding="utf-8")):
            found.append((page, match["name"], int(match["value"].replace(",", ""))))
    return found


def pytest_collection_finish(session) -> None:
    """Plugin hook (``-p doc_counts``): write the collected items' counts to ``$DOC_COUNTS_OUT``."""
    counts: dict[str, int] = {"tests": 0, "fast-tests": 0}
    for item in session.items:
        path = item.nodeid.split("::")[0]
        counts["tests"] += 1
        counts[f"tests:{path}"] = counts.get(f"tests:{path}", 0) + 1
        if not path.startswith("tests/integration/") and item.get_closest_marker("slow") is None:
            counts["fast-tests"] += 1
    Path(os.environ["DOC_COUNTS_OUT"]).write_text(json.dumps(counts), encoding="utf-8")


def suite_counts(repo: Path = REPO) -> dict[str, int]:
    """Collect the suite once (nothing runs) and count its items."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        env = {
            **os.environ,
            "DOC_COUNTS_OUT": str(out),
            "PYTHONPATH": os.pathsep.join(
                [str(repo / "tools"), str(repo), os.environ.get("PYTHONPATH", "")]
            ),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "doc_counts"]
            + ["-p", "no:cacheprovider", "tests"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"collecting the tests failed:\n{proc.stdout[-3000:]}")
        return json.loads(out.read_text(encoding="utf-8"))


def file_counts(repo: Path = REPO) -> dict[str, int]:
    """Modules of the package (in all and per folder) and the recipes in ``configs/``."""
    package = repo / "xtuner_rope"
    modules = sorted(package.rglob("*.py"))
    counts = {"modules": len(modules), "configs": len(list((repo / "configs").glob("*.py")))}
    for module in modules:
        parts = module.relative_to(package).parts
        if len(parts) > 1:
            counts[f"modules:{parts[0]}"] = counts.get(f"modules:{parts[0]}", 0) + 1
    return counts


def code_counts(names: set[str], repo: Path = REPO) -> dict[str, int]:
    """The code's value of each count named (the suite is collected only if a test count is)."""
    counts = file_counts(repo)
    if any(name == "tests" or name.startswith(("tests:", "fast-tests")) for name in names):
        counts.update(suite_counts(repo))
    return counts


def drifts(repo: Path = REPO) -> list[str]:
    """Every stated count that is not the code's, as ``page: name states X, the code has Y``."""
    claims = stated(repo)
    actual = code_counts({name for _, name, _ in claims}, repo)
    return [
        f"{page.relative_to(repo)}: count:{name} states {value:,}, the code has "
        f"{actual.get(name, 0):,}"
        for page, name, value in claims
        if actual.get(name, 0) != value
    ]


def write(repo: Path = REPO) -> int:
    """Rewrite every count marker with the code's value; returns how many changed."""
    claims = stated(repo)
    actual = code_counts({name for _, name, _ in claims}, repo)
    changed = 0
    for page in pages(repo):
        text = page.read_text(encoding="utf-8")

        def fill(match: re.Match) -> str:
            return f"<!-- count:{match['name']} -->{actual.get(match['name'], 0):,}<!-- /count -->"

        new = MARKER.sub(fill, text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed += 1
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the pages' counts")
    args = parser.parse_args()
    if args.write:
        print(f"{write()} page(s) rewritten")
        return 0
    problems = drifts()
    for problem in problems:
        print(problem)
    print(f"{len(stated())} stated counts, {len(problems)} differ from the code")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
