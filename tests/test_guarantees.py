"""The checked map from each guarantee to the CI tests that fail when it is turned off.

``tests/support/guarantees.py`` holds the map. Here, in CI: every guarantee's code is still
where the map says (its mutation applies exactly once), every mapped test is collected in CI
and is not a ``slow`` run, and each guarantee turned off in a scratch copy of the repository
makes every one of its mapped tests fail (a test skipped there would not fail, so an opt-in
test cannot stand in for a CI one).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from guarantees import GUARANTEES, REPO, mutate, run_mutation


def test_every_guarantee_has_its_code_and_ci_tests(tmp_path):
    names = [g.name for g in GUARANTEES]
    assert len(names) == len(set(names))
    for guarantee in GUARANTEES:
        assert guarantee.tests, f"{guarantee.name}: no test mapped"
        target = tmp_path / guarantee.file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((REPO / guarantee.file).read_text(encoding="utf-8"), encoding="utf-8")
        mutate(tmp_path, guarantee)  # raises unless its code occurs exactly once
        assert target.read_text(encoding="utf-8") != (REPO / guarantee.file).read_text()


def test_every_mapped_test_is_collected_in_ci_and_fast():
    """``pytest --collect-only -m "not slow"`` lists each mapped node id: it exists, and it is
    not one of the slow end-to-end runs (they prove other things, at other costs)."""
    nodes = sorted({test for g in GUARANTEES for test in g.tests})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow"]
        + ["-p", "no:cacheprovider", *nodes],
        cwd=REPO,
        env=dict(os.environ, CI="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    collected = set(proc.stdout.split())
    assert not [n for n in nodes if n not in collected], proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("guarantee", GUARANTEES, ids=lambda g: g.name)
def test_turning_a_guarantee_off_fails_its_tests(guarantee):
    failed, out = run_mutation(guarantee)
    missed = sorted(set(guarantee.tests) - failed)
    assert not missed, f"{guarantee.name} off, still passing: {missed}\n{out[-3000:]}"
    print(f"{guarantee.name} off: {len(failed)} of {len(guarantee.tests)} mapped tests fail")
