"""A hook that SIGKILLs its own training process after a given iteration (resume tests).

Imported by the configs the resume tests write (``from sigkill_hook import
SigkillAtIterationHook``; ``tests/support`` on ``PYTHONPATH``). The iteration comes from the
environment, so the same config file serves the killed run (``XTUNER_ROPE_SIGKILL_AT=6``) and its
resume (unset): a real ``SIGKILL``, no clean shutdown, no ``after_train`` hook, nothing flushed.
"""

import os
import signal

from mmengine.hooks import Hook

KILL_ENV = "XTUNER_ROPE_SIGKILL_AT"


class SigkillAtIterationHook(Hook):
    """``os.kill(getpid(), SIGKILL)`` once iteration ``$XTUNER_ROPE_SIGKILL_AT`` has finished."""

    priority = "LOWEST"  # after CheckpointHook (90): a checkpoint due at that iteration is written

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        at = os.environ.get(KILL_ENV)
        if at and runner.iter + 1 == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
