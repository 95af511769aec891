"""The held-out evaluation's start-up, a module per concern.

- ``findings``: the held-out rows prepared as the train rows (``val_dataloader``,
  ``TokenLossMetric`` / ``PreferenceMetric``, ``HeldOutCurvesHook``), and its refusals;
- ``files``: a missing or empty held-out data file, refused before a weight loads;
- ``models``: which metric serves which model, and held-out preference pairs;
- ``shortcut``: ``heldout = dict(...)`` in PART 1, the entries above derived from it.

Importing the package registers the findings of ``findings`` and ``shortcut``.
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
