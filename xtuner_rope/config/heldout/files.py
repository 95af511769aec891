"""The held-out data files of ``val_dataloader``: each local file must exist and hold a dialogue.

A start-up check of :mod:`xtuner_rope.config.heldout.findings`: a missing or empty held-out file is
refused before any weight loads, naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..fields import lazy_get as _get
from ..fields import walk_datasets as _datasets
from ..findings import Finding


def _local_files(node: object) -> list[str]:
    """The local data files of a dataset dict: ``load_dataset``'s ``data_files`` and a local
    ``path``, LLaVA's ``data_path``, InternVL's ``data_paths``."""
    files = _get(node, "data_files")
    if isinstance(files, dict):
        files = [f for v in files.values() for f in (v if isinstance(v, (list, tuple)) else [v])]
    files = list(files) if isinstance(files, (list, tuple)) else [files] if files else []
    for key in ("data_path", "data_paths"):  # LLaVADataset, InternVL_V1_5_Dataset
        value = _get(node, key)
        files += list(value) if isinstance(value, (list, tuple)) else [value] if value else []
    path = _get(node, "path")
    if isinstance(path, str) and path.startswith(("/", ".", "~")):
        files.append(path)
    return [str(f) for f in files if isinstance(f, (str, Path))]


def _empty(path: Path) -> bool:
    """No dialogue in a local data file (0 bytes, blank, ``[]``) or a folder of such files."""
    if path.is_dir():
        return all(_empty(p) for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    if path.stat().st_size > 1 << 20:
        return False
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if text in ("", "[]"):
        return True
    if path.suffix == ".json":
        try:
            return json.loads(text) in ([], {})
        except ValueError:
            return False
    return False


def heldout_file_findings(loader: dict) -> list[Finding]:
    """A held-out data file that is missing or holds no dialogue, refused before a weight loads:
    one finding per such local file of ``loader`` (``val_dataloader``; nested datasets too).
    """
    findings = []
    for where, dataset in _datasets(_get(loader, "dataset"), "val_dataloader.dataset"):
        for name in _local_files(dataset):
            path = Path(name).expanduser()
            problem = (
                "does not exist"
                if not path.exists()
                else "holds no dialogue (empty)"
                if _empty(path)
                else None
            )
            if problem:
                findings.append(
                    Finding(
                        f"{where} (held-out data {name})",
                        f"the held-out data file {problem}",
                        "point val_dataloader's dataset at a file of held-out dialogues in the "
                        "training data's format, or remove val_dataloader, val_evaluator and "
                        "val_cfg",
                    )
                )
    return findings


__all__ = ["heldout_file_findings"]
