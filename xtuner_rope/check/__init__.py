"""``xtuner-rope check``: prove isolation on the user's own model, dtype, kernel and data.

Floors, lowest first: ``runner``, ``report``, one module per kind, ``kinds``; the measurements
live in :mod:`xtuner_rope.capture`. The names below are the command's API.
"""

from xtuner_rope.check.kinds import KINDS, format_summary, kind_of, run_check
from xtuner_rope.check.report import TOLERANCES, figures, judge, report_head, write_report
from xtuner_rope.check.runner import (
    DTYPES,
    CheckRequest,
    PreparedRunner,
    apply_patch,
    build_runner,
    first_batches,
    plugin_hooks,
    prepared_runner,
    start_config,
    train_dtype,
)
from xtuner_rope.check.text import measure

__all__ = [
    "DTYPES",
    "KINDS",
    "TOLERANCES",
    "CheckRequest",
    "PreparedRunner",
    "apply_patch",
    "build_runner",
    "figures",
    "first_batches",
    "format_summary",
    "judge",
    "kind_of",
    "measure",
    "plugin_hooks",
    "prepared_runner",
    "report_head",
    "run_check",
    "start_config",
    "train_dtype",
    "write_report",
]
