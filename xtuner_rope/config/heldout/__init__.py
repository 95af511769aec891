"""The held-out evaluation's start-up: ``findings`` (the held-out rows prepared as the train rows),
``files`` (a missing or empty data file), ``models`` (which metric serves which model, held-out
pairs), ``shortcut`` (``heldout = dict(...)``). Importing it registers ``findings`` and
``shortcut``.
"""

from . import files, findings, models, shortcut
from .findings import CURVES_HOOK, heldout_findings, heldout_metrics

__all__ = [
    "CURVES_HOOK",
    "files",
    "findings",
    "heldout_findings",
    "heldout_metrics",
    "models",
    "shortcut",
]
