"""The `make demo` recipe is the default recipe plus its held-out setting, line for line.

MMEngine refuses a plain ``_base_`` for configs that import classes (XTuner's style: "The
configuration file type in the inheritance chain must match"), so the held-out recipe repeats
the default one; this keeps the copy from drifting.
"""

from __future__ import annotations

from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _code(path: Path) -> list[str]:
    """The file's lines without comments and blank lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_heldout_recipe_is_the_default_recipe_plus_the_heldout_setting():
    default = _code(CONFIGS / "tiny_internlm2_short_dialogues.py")
    heldout = _code(CONFIGS / "tiny_internlm2_short_dialogues_heldout.py")
    added = [line for line in heldout if line not in default]
    assert added == ["heldout = dict(fraction=0.05, interval=50)"], added
    assert [line for line in heldout if line != added[0]] == default
