"""The file a ``NonFiniteTripwireHook`` failure leaves: one batch and how to rebuild its pass."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["RECORD_FORMAT", "load_record", "save_record"]

RECORD_FORMAT = "xtuner_rope.nonfinite/1"


def save_record(path: str | Path, record: dict) -> Path:
    """Write a failure record (tensors, numbers, strings only: loadable with weights_only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(record, format=RECORD_FORMAT), path)
    return path


def load_record(path: str | Path) -> dict:
    """Read a record written by :func:`save_record`.

    Raises:
        ValueError: the file is not such a record.
    """
    record = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        got = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"load_record: {path}: expected a NonFiniteTripwireHook batch file "
            f"(format {RECORD_FORMAT!r}), got {got!r}. Pass the file named in the "
            "tripwire error."
        )
    return record
