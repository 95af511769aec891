"""A hook that records every training batch the model receives (whole-dialogue packing proof).

Imported by the configs ``tests/integration/test_whole_packing_train.py`` writes (``from
record_batches_hook import RecordBatchesHook``; ``tests/support`` on ``PYTHONPATH``). Each
iteration's ``input_ids``, ``labels`` and ``cumulative_len`` go to
``<work_dir>/batches.pt`` at the end of training.
"""

from pathlib import Path

import torch
from mmengine.hooks import Hook


class RecordBatchesHook(Hook):
    """Keep each batch's rows and boundaries; reads ``data_batch`` only (nothing changed)."""

    priority = 1  # before PackedBatchCheckHook (8), which pops the boundaries

    def __init__(self):
        self.batches = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        data = data_batch["data"]
        self.batches.append(
            {
                "input_ids": data["input_ids"].clone(),
                "labels": data["labels"].clone(),
                "cumulative_len": [torch.as_tensor(c).clone() for c in data["cumulative_len"]],
            }
        )

    def after_train(self, runner):
        torch.save(self.batches, Path(runner.work_dir) / "batches.pt")
