"""The README's first screen and the documentation site (`mkdocs.yml`, `docs/`).

The README is what a newcomer reads first: short, the two commands and the one edit on its
first screen. Everything else lives in the mkdocs site, whose strict build fails on a broken
link, a broken anchor or a page left out of the nav; `docs/incoming/` (notes not yet folded
into a page) is excluded from the site.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
# The venv's own mkdocs (the one `make docs` runs), next to the interpreter running the tests.
MKDOCS = Path(sys.executable).parent / "mkdocs"
ONE_EDIT = (
    "from xtuner_rope import enable_xtuner_rope",
    "model_resource = dict(fn=enable_xtuner_rope)",
)
FIRST_SCREEN = 50  # lines
MAX_README_LINES = 150

# [text](target) and ![alt](target); the target up to the first space or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*```")
CODE_SPAN = re.compile(r"`[^`]*`")


def _pages() -> list[Path]:
    """The site's markdown sources, without the excluded `docs/incoming/` notes."""
    return sorted(p for p in DOCS.rglob("*.md") if "incoming" not in p.relative_to(DOCS).parts)


def _links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link outside code fences and code spans."""
    found, fence = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fence = not fence
            continue
        if not fence:
            found += [(number, target) for target in LINK.findall(CODE_SPAN.sub("", line))]
    return found


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    if not MKDOCS.is_file():
        pytest.fail(f"{MKDOCS} missing: mkdocs is a dev extra (setup.cfg), run `make setup`")
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_readme_is_short_and_its_first_screen_has_the_commands_and_the_one_edit():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move detail to docs/"
    first = "\n".join(lines[:FIRST_SCREEN])
    for needed in (
        "make demo",
        "make test",
        *ONE_EDIT,
        "xtuner 0.2.0",
        "mmengine 0.10.6",
        "transformers 4.48.0",
    ):
        assert needed in first, f"README's first {FIRST_SCREEN} lines lack {needed!r}"
    # The one edit is a python block a user can copy, the two lines together.
    assert "```python\n" + "\n".join(ONE_EDIT) + "\n```" in first


def test_readme_states_the_pinned_torch():
    pinned = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pinned and f"torch {pinned.group(1)}" in README.read_text(encoding="utf-8")


def test_every_relative_link_resolves():
    broken = []
    for path in [README, *_pages()]:
        for number, target in _links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor of the page itself (mkdocs checks those)
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(REPO)}:{number}: {target}")
    assert not broken, broken
    assert _links(README), "the README links to no docs page"


# A repository file the text tells users to run or read: `tests/...py`, `tools/...py`, `configs/...`.
REPO_FILE = re.compile(
    r"(?<![\w/.])((?:tests|tools|configs|data)/[\w./-]+\.(?:py|sh|jsonl|json))\b"
)


def test_every_named_repository_file_exists():
    """Commands in the docs name test files, tools and recipes: each must be there (moves too)."""
    missing = []
    for path in [README, *_pages()]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in REPO_FILE.findall(line):
                if not (REPO / name).exists() and not any(REPO.glob(name)):
                    missing.append(f"{path.relative_to(REPO)}:{number}: {name}")
    assert not missing, missing


def test_docs_home_is_the_readme_with_links_into_docs():
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    readme = README.read_text(encoding="utf-8")
    comment, body = home.split("\n", 1)
    assert comment.startswith("<!--") and body == readme.replace("](docs/", "]("), (
        "docs/index.md must be README.md with its links made relative to docs/"
    )


def test_mkdocs_strict_build(tmp_path):
    built = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    site = tmp_path / "site"
    for page in _pages():
        name = page.relative_to(DOCS).with_suffix("")
        html = site / (name.parent if name.name == "index" else name) / "index.html"
        assert html.is_file(), f"{page.relative_to(REPO)} was not built"
    assert not (site / "incoming").exists(), "docs/incoming/ must stay out of the site"


@pytest.mark.parametrize("broken", ["[x](no-such-page.md)", "[x](packing.md#no-such-heading)"])
def test_mkdocs_strict_build_fails_on_a_broken_link(tmp_path, broken):
    """The strict build is a real check: a copy of the site with one broken link fails."""
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    with open(tmp_path / "docs" / "status.md", "a", encoding="utf-8") as page:
        page.write(f"\n{broken}\n")
    built = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "no-such" in built.stdout + built.stderr


def _doc_counts():
    """``tools/doc_counts.py`` as a module (tools/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("doc_counts", REPO / "tools" / "doc_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_drifted_count_is_reported(tmp_path):
    """Negative control of the counts below: a page stating 3 modules of a 2-module package."""
    counts = _doc_counts()
    (tmp_path / "xtuner_rope" / "ops").mkdir(parents=True)
    for name in ("__init__.py", "ops/__init__.py"):
        (tmp_path / "xtuner_rope" / name).write_text('"""."""\n')
    (tmp_path / "configs").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- count:modules -->3<!-- /count --> modules\n")
    (tmp_path / "docs" / "a.md").write_text("`ops/` <!-- count:modules:ops -->1<!-- /count -->\n")
    assert counts.drifts(tmp_path) == ["README.md: count:modules states 3, the code has 2"]
    assert counts.write(tmp_path) == 1
    assert counts.drifts(tmp_path) == []
    assert "<!-- count:modules -->2<!-- /count -->" in (tmp_path / "README.md").read_text()


def test_stated_module_and_config_counts_are_the_codes():
    counts = _doc_counts()
    actual = counts.file_counts(REPO)
    stated = [(p, n, v) for p, n, v in counts.stated(REPO) if n.startswith(("modules", "configs"))]
    assert stated, "the docs state the package's module counts (docs/architecture.md)"
    wrong = [
        f"{page.relative_to(REPO)}: count:{name} states {value}, the code has {actual.get(name)}"
        for page, name, value in stated
        if actual.get(name) != value
    ]
    assert not wrong, "run `python tools/doc_counts.py --write`:\n" + "\n".join(wrong)


@pytest.mark.slow  # collects the whole suite once (~20 s on an idle machine; nothing runs)
def test_stated_test_counts_are_the_codes():
    drifted = _doc_counts().drifts(REPO)
    assert not drifted, "run `python tools/doc_counts.py --write`:\n" + "\n".join(drifted)
