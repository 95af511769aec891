"""The 2,400 short chat dialogues the package ships (``short_dialogues.jsonl``, package data)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

__all__ = ["sample_dialogues", "sample_path"]

FILE_NAME = "short_dialogues.jsonl"


def sample_path() -> Path:
    """The shipped file's path (the installed package's own folder: wheel or editable).

    Raises:
        FileNotFoundError: The install lacks its package data.
    """
    path = Path(str(resources.files(__package__) / FILE_NAME))
    if not path.is_file():
        raise FileNotFoundError(
            f"xtuner_rope's sample dialogues are missing: no file {path}. The install lacks "
            "its package data (setup.cfg [options.package_data]); reinstall xtuner-rope, or "
            "pass your own dialogues (data_path=...)"
        )
    return path


def sample_dialogues(n: int | None = None) -> list[dict]:
    """The first ``n`` shipped dialogues (all 2,400 when None), ``{"messages": [...]}`` records.

    Raises:
        ValueError: ``n`` is more than the file holds.
    """
    with sample_path().open(encoding="utf-8") as f:
        dialogues = [json.loads(line) for line in f if line.strip()]
    if n is not None and n > len(dialogues):
        raise ValueError(
            f"sample_dialogues: n={n}, but the shipped sample holds {len(dialogues)} "
            "dialogues; ask for fewer"
        )
    return dialogues if n is None else dialogues[:n]
