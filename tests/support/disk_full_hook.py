"""A hook that fills the "disk" of its own training process after a given iteration.

Imported by the configs the checkpoint-crash test writes (``from disk_full_hook import
DiskFullAfterIterationHook``; ``tests/support`` on ``PYTHONPATH``). From iteration
``$XTUNER_ROPE_DISK_FULL_AT`` on, no file of the process may grow past
``$XTUNER_ROPE_DISK_FULL_BYTES``: a real ``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored so the kernel
fails the write with ``EFBIG`` where a full disk fails it with ``ENOSPC`` (both leave the bytes
written so far). Unset, the hook does nothing: the same config serves the resumed runs.
"""

import os
import resource
import signal

from mmengine.hooks import Hook

AT_ENV, BYTES_ENV = "XTUNER_ROPE_DISK_FULL_AT", "XTUNER_ROPE_DISK_FULL_BYTES"


class DiskFullAfterIterationHook(Hook):
    """Limit file sizes once iteration ``$XTUNER_ROPE_DISK_FULL_AT`` has finished."""

    priority = "VERY_HIGH"  # before CheckpointHook (90): a checkpoint due there already fails

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        at = os.environ.get(AT_ENV)
        if at and runner.iter + 1 == int(at):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ[BYTES_ENV]), hard))
