"""Hooks that SIGKILL their own training process: after a given iteration, or halfway through
a checkpoint write (resume and crash-safety tests).

Imported by the configs the resume tests write (``from sigkill_hook import
SigkillAtIterationHook``; ``tests/support`` on ``PYTHONPATH``). The iteration comes from the
environment, so the same config file serves the killed run (``XTUNER_ROPE_SIGKILL_AT=6``) and its
resume (unset): a real ``SIGKILL``, no clean shutdown, no ``after_train`` hook, nothing flushed.
``SigkillDuringCheckpointWriteHook`` (``XTUNER_ROPE_SIGKILL_IN_WRITE=iter_8.pth``) kills it
inside the write of that checkpoint, half of its bytes out.
"""

import builtins
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


WRITE_ENV = "XTUNER_ROPE_SIGKILL_IN_WRITE"


class _HalfThenKill:
    """A file opened for writing that writes half of its first ``write`` and is then killed."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        self._file.write(data[: len(data) // 2])
        self._file.flush()
        os.fsync(self._file.fileno())  # the half is on disk, as a kill mid-write leaves it
        os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)


def _names(path: str, name: str) -> bool:
    """Whether ``path`` is the file ``name`` names (``FILE`` or ``FOLDER/FILE``) or its temporary."""
    folder, _, file = name.rpartition("/")
    if folder and os.path.basename(os.path.dirname(path)) != folder:
        return False
    return file in os.path.basename(path)


class SigkillDuringCheckpointWriteHook(Hook):
    """``SIGKILL`` halfway through writing the checkpoint ``$XTUNER_ROPE_SIGKILL_IN_WRITE``.

    From the start of training (MMEngine 0.10.6's ``DeepSpeedStrategy.save_checkpoint`` never
    calls ``before_save_checkpoint``), every ``open(..., "wb")`` of a file whose name contains that
    checkpoint's name (``iter_8.pth``: MMEngine's final path, or the plugin's temporary
    ``.iter_8.pth.<pid>.tmp``) returns a file that writes the first half of the bytes, syncs
    them and kills the process: what a kill, an OOM killer or a power cut during ``torch.save``'s
    write leaves. ``FOLDER/FILE`` (``iter_8.pth/zero_pp_rank_1_mp_rank_00_optim_states.pt``)
    kills inside a DeepSpeed checkpoint folder: the file of that name (or its temporary) in a
    folder of that name, so only the process that writes it dies (here rank 1, after rank 0's
    files). Unset, the hook does nothing.
    """

    priority = "LOWEST"

    def before_train(self, runner):
        name = os.environ.get(WRITE_ENV)
        if not name or getattr(builtins.open, "kills_in_write", False):
            return  # unset, or installed already
        original = builtins.open

        def killing_open(file, mode="r", *args, **kwargs):
            handle = original(file, mode, *args, **kwargs)
            if "w" in mode and _names(str(file), name):
                return _HalfThenKill(handle)
            return handle

        killing_open.kills_in_write = True
        builtins.open = killing_open
