"""`docs/compat.md` lists every patch `compat.apply()` runs (issue 42: five were missing).

The list is read from the code: the records `apply()` loops over (`records.ACTIVATION`), and each
must appear in the page by its name.
"""

from __future__ import annotations

from pathlib import Path

from xtuner_rope import compat
from xtuner_rope.compat import records

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "compat.md"


def applied_patches() -> list[str]:
    """The names of the patches ``compat.apply()`` runs, in order (``records.ACTIVATION``)."""
    return [record.name for record in records.ACTIVATION]


def missing_from(text: str) -> list[str]:
    """The patches of ``apply()`` that ``text`` does not name (as `` `name` ``)."""
    return [name for name in applied_patches() if f"`{name}`" not in text]


def test_the_patch_list_is_read_from_apply():
    names = applied_patches()
    assert len(names) == len(set(names)) >= 20
    assert all(callable(compat.patch_named(name)) for name in names)
    assert names[0] == "patch_torch_cpu_bf16_query"  # the first gap every CPU run hits


def test_compat_page_names_every_patch_apply_runs():
    assert not missing_from(PAGE.read_text(encoding="utf-8")), (
        "docs/compat.md lacks these patches of compat.apply(): add a row for each"
    )


def test_a_page_without_one_patch_is_caught():
    text = PAGE.read_text(encoding="utf-8").replace("`patch_internvl_rank`", "InternVL rank")
    assert missing_from(text) == ["patch_internvl_rank"]
