"""A hook that records which documents (dialogues) each process trains, iteration by iteration.

Imported by the configs ``tests/integration/test_resume.py`` writes (``from
record_documents_hook import RecordDocumentsHook``; ``tests/support`` on ``PYTHONPATH``). Each
iteration appends one JSON line to ``<work_dir>/documents_rank<r>.jsonl``, flushed at once so a
``SIGKILL`` loses nothing: ``{"iter", "world", "docs"}``, ``docs`` a fingerprint (SHA-1 of the
token ids) of each document of the batch, cut at its ``cumulative_len`` boundaries (padding
segments, without a supervised label, left out).
"""

import hashlib
import json
from pathlib import Path

import torch
from mmengine.dist import get_rank, get_world_size
from mmengine.hooks import Hook


def _fingerprints(data: dict) -> list[str]:
    found = []
    for row, labels, bounds in zip(data["input_ids"], data["labels"], data["cumulative_len"]):
        bounds = torch.as_tensor(bounds).tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start and bool((labels[start:end] != -100).any()):
                tokens = row[start:end].to(torch.int64).numpy().tobytes()
                found.append(hashlib.sha1(tokens).hexdigest()[:16])
    return found


class RecordDocumentsHook(Hook):
    """Append each iteration's document fingerprints; reads ``data_batch`` only."""

    priority = 1  # before PackedBatchCheckHook (8), which pops the boundaries

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        line = {
            "iter": runner.iter + 1,
            "world": get_world_size(),
            "docs": _fingerprints(data_batch["data"]),
        }
        path = Path(runner.work_dir) / f"documents_rank{get_rank()}.jsonl"
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
