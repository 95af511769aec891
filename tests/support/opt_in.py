"""Runs that prove a claim a second time: opt-in, out of CI (``make test-all`` runs them).

CI keeps one real run per claim (issue 47). A run that proves again what another CI test
proves (another family through the same multi-process path, another optimizer through the
same resume) is marked with :func:`again`, naming the CI test that proves the claim; its
figures stay in the docs. ``XTUNER_ROPE_AGAIN=1`` (set by ``make test-all``) runs them.
"""

from __future__ import annotations

import os

import pytest

AGAIN = os.environ.get("XTUNER_ROPE_AGAIN") == "1"


def again(proved_by: str):
    """Skip unless ``XTUNER_ROPE_AGAIN=1``: the claim is proven in CI by ``proved_by``."""
    return pytest.mark.skipif(
        not AGAIN, reason=f"opt-in (make test-all): proven in CI by {proved_by}"
    )
