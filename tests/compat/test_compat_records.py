"""Every patch has a record (versions, probes, feature), a start-up map entry and a docs row.

The patch list is read from ``compat.apply()``'s loop (as tests/compat/test_compat_docs.py
does); the records are checked against the installed (pinned) stack: each version range
holds and each probe resolves here, so a record that names a wrong target fails now, not on
a user's newer release.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

from packaging.specifiers import SpecifierSet

from xtuner_rope import compat
from xtuner_rope.compat import guard, records
from xtuner_rope.config.patch_needs import CONDITIONS, needs_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "compat.md"


def applied_patches() -> list[str]:
    """What ``apply()`` runs (``records.ACTIVATION``, each its patch imported by ``compat``) and
    the two that ``apply_counting`` runs with the ``data`` floor's wrappers handed in."""
    names = [r.name for r in records.ACTIVATION + records.COUNTING]
    assert all(callable(compat.patch_named(name)) for name in names), names
    counting = ast.parse(textwrap.dedent(inspect.getsource(compat.apply_counting)))
    handed = [
        node.args[0].attr
        for node in ast.walk(counting)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_patch"
    ]
    assert sorted(handed) == sorted(r.name for r in records.COUNTING), handed
    return names


def _patch_functions() -> set[str]:
    """The functions the modules of ``compat`` define (a record names one of them)."""
    import importlib
    import pkgutil

    found = set()
    for info in pkgutil.iter_modules(compat.__path__):
        module = importlib.import_module(f"xtuner_rope.compat.{info.name}")
        found |= {
            name
            for name, value in vars(module).items()
            if callable(value) and getattr(value, "__module__", None) == module.__name__
        }
    return found


def test_every_patch_of_apply_and_every_later_one_has_a_record():
    names = applied_patches()
    assert len(names) >= 26
    assert set(names) | {r.name for r in records.DEFERRED} == set(records.RECORDS)
    defined = _patch_functions()
    for name, record in records.RECORDS.items():
        assert name in defined, name
        assert record.versions and record.feature and record.symptom, name
        assert record.probes or record.probe_note, name
        for spec in record.versions.values():
            SpecifierSet(spec)  # a typo in a range raises here


def test_every_record_holds_on_the_pinned_stack():
    for record in records.RECORDS.values():
        assert guard._why_not(record) in (None, ("not needed", "its gap does not exist here")), (
            record.name
        )
    assert guard.skipped() == {}  # nothing skipped by the activation here


def test_every_record_is_mapped_to_the_configs_that_need_it():
    """One record per patch holds the whole truth: its configs, or why none is refused."""
    for record in records.RECORDS.values():
        assert (record.needs is None) != (not record.not_refused), record.name
        if record.needs is not None:
            words, condition = record.needs
            assert words and condition in CONDITIONS, record.name
    used = {r.needs[1] for r in records.RECORDS.values() if r.needs}
    assert used == set(CONDITIONS), f"conditions no record names: {set(CONDITIONS) - used}"


def _block(text: str, marker: str) -> str:
    start, end = f"<!-- {marker} -->\n", f"\n<!-- /{marker} -->"
    return text.split(start, 1)[1].split(end, 1)[0]


def test_the_compat_page_shows_the_records_and_the_map():
    text = PAGE.read_text(encoding="utf-8")
    assert _block(text, "records") == records.records_table()
    assert _block(text, "needs") == needs_table()


def test_a_page_with_a_stale_version_is_caught():
    text = PAGE.read_text(encoding="utf-8").replace(
        "| mmengine ~=0.10.6 |", "| mmengine ~=0.10.5 |", 1
    )
    assert _block(text, "records") != records.records_table()
