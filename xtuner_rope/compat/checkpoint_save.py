"""Checkpoints that survive a crash: written whole or not at all, resumed only when complete.

MMEngine 0.10.6 writes ``iter_N.pth`` with ``torch.save`` straight to its final name
(``runner.checkpoint.save_checkpoint``, ``LocalBackend.put``), DeepSpeed 0.19.6 each rank's
``*_states.pt`` the same way (``TorchCheckpointEngine.save``), and ``CheckpointHook`` deletes the
oldest checkpoint beyond ``max_keep_ckpts`` *before* writing the new one. A kill, a crash or a full
disk during the write leaves a truncated newest checkpoint that ``last_checkpoint`` may name and
that ``--resume`` dies on deep in torch's reader (with ``max_keep_ckpts = 1``, the only one).

The patches (:func:`patch_checkpoint_writes` for MMEngine,
:func:`patch_deepspeed_checkpoint_writes` for DeepSpeed, applied by ``compat.apply()``):

- ``save_checkpoint`` (MMEngine, local paths) and ``TorchCheckpointEngine.save`` (DeepSpeed):
  ``torch.save`` streams the file to a hidden temporary name in the same folder (no copy of the
  object in memory, as in DeepSpeed's own save), which is flushed to disk and renamed to its
  final name (``os.replace``, atomic on POSIX): the final name holds a complete checkpoint or
  none. ``CheckpointHook`` writes ``last_checkpoint`` after the save returned, so it names
  complete checkpoints only.
- A write that fails (no space, quota, file size limit, read-only or unwritable folder) raises
  :class:`CheckpointWriteError` naming the path, the bytes needed and the free space there; the
  temporary file is removed and the previous checkpoints are left as they were.
- ``CheckpointHook._save_checkpoint_with_step``: the checkpoint beyond ``max_keep_ckpts`` is deleted
  after the new one is complete, not before.
- ``find_latest_checkpoint`` (MMEngine's auto-resume, ``resume = True`` without ``load_from``):
  when ``last_checkpoint`` names an incomplete checkpoint (or one that is gone), the newest complete
  checkpoint in its folder is resumed instead, with a warning naming both.
- ``--resume`` and auto-resume of a ZeRO checkpoint written by another number of processes are
  refused before it loads (``checkpoint_world.refuse_other_world_size``).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys

import torch
from mmengine.logging import print_log

from .checkpoint import PATH_CHECKS as _PATH_CHECKS  # the loaders' checks (one list)
from .checkpoint import RESUME_CHECKS as _RESUME_CHECKS
from .checkpoint_files import (
    checkpoint_number,
    judge_checkpoint,
    newest_complete,
    numbered_checkpoints,
    refuse_incomplete,
)
from .checkpoint_world import refuse_other_world_size

_ORIGINAL: dict[str, object] = {}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written whole (disk full, quota, unwritable folder)."""


def _free_bytes(folder: str) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _write_error(path: str, size: int, err: OSError) -> CheckpointWriteError:
    """The error for a failed write: path, bytes needed, free space, what to do."""
    folder = os.path.dirname(os.path.abspath(path))
    free = _free_bytes(folder)
    where = f"{free} bytes free in {folder}" if free is not None else f"{folder} unreadable"
    # A DeepSpeed rank file lies inside its checkpoint folder (iter_N.pth/): look beside that.
    inside = checkpoint_number(folder)
    where_ckpts = os.path.dirname(folder) if inside else folder
    named = inside or checkpoint_number(path) or ("iter", 0)
    previous = newest_complete(where_ckpts, named[0], exclude=folder if inside else None)
    kept = f"the newest complete checkpoint is {previous}" if previous else "none complete yet"
    return CheckpointWriteError(
        err.errno or errno.EIO,
        f"xtuner-rope: could not write checkpoint {path}: it needs {size} bytes "
        f"({size / 2**20:.1f} MiB), {where}; the write failed with "
        f"[Errno {err.errno}] {err.strerror or err}. Nothing was left under its name and the "
        f"checkpoints written before are intact ({kept}). Make room (or lower max_keep_ckpts), "
        "or give a --work-dir on a disk with space that you can write, then resume"
        + (f" with --resume {previous}" if previous else ""),
    )


def _remove_stale_temporaries(folder: str, name: str) -> None:
    """Delete the temporaries of ``name`` that a process killed mid-write left in ``folder``.

    No two processes write the same checkpoint name at once (each DeepSpeed rank has its own
    files), so any ``.name.<pid>.tmp`` found before a write is a dead writer's, as large as the
    part of a checkpoint it got out.
    """
    prefix = f".{name}."
    for entry in os.listdir(folder):
        if entry.startswith(prefix) and entry.endswith(".tmp"):
            try:
                os.remove(os.path.join(folder, entry))
            except OSError:  # gone already, or not ours to remove: the write goes on
                pass


class _Stream:
    """The temporary file as ``torch.save`` sees it: every write goes through :meth:`write`.

    torch writes to a file object with a descriptor behind Python's back (its legacy format
    calls ``write()`` on the descriptor) and reports a failed write as ``RuntimeError`` (also
    its zip writer, which raises ``unexpected pos`` while handling the ``OSError``): here
    the file has no ``fileno`` for torch, and the disk's ``OSError`` is kept as it was raised.
    """

    def __init__(self, file) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._file.flush()


def _atomic_write(path: str, write, size) -> None:
    """Write a file at ``path`` whole or not at all: a temporary name, fsync, ``os.replace``.

    Args:
        path: The final path; its folder is created if missing.
        write: Called with the temporary file open for binary writing (a :class:`_Stream`:
            ``write`` and ``flush``); writes the content.
        size: Called only when the write failed: the bytes the content needs (for the error).

    Raises:
        CheckpointWriteError: The folder cannot be written or has no room; ``path`` is
            untouched and no temporary file remains.
    """
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    stream = None
    try:
        os.makedirs(folder, exist_ok=True)
        _remove_stale_temporaries(folder, os.path.basename(path))
        with open(temporary, "wb") as f:
            stream = _Stream(f)
            write(stream)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.replace(temporary, path)
    except BaseException as err:  # a full disk, a pickling error, Ctrl-C: no temporary left
        try:
            os.remove(temporary)
        except OSError:
            pass
        failed = err if isinstance(err, OSError) else getattr(stream, "error", None)
        if failed is not None:
            raise _write_error(path, size(), failed) from err
        raise
    try:  # the rename itself on disk (best effort: not every filesystem opens folders)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_atomically(data: bytes, path: str) -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary name, fsync, ``os.replace``.

    Args:
        data: The file's bytes.
        path: The final path; its folder is created if missing.

    Raises:
        CheckpointWriteError: The folder cannot be written or has no room; ``path`` is
            untouched and no temporary file remains.
    """
    _atomic_write(path, lambda f: f.write(data), lambda: len(data))


class _ByteCount:
    """A write-only sink that counts what ``torch.save`` writes to it and keeps nothing."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        self.size += memoryview(data).nbytes
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def _saved_size(obj, torch_save_kwargs: dict) -> int:
    """The bytes ``torch.save(obj, **torch_save_kwargs)`` writes, counted without keeping them."""
    sink = _ByteCount()
    torch.save(obj, sink, **torch_save_kwargs)
    return sink.size


def save_atomically(obj, path: str, **torch_save_kwargs) -> None:
    """``torch.save(obj)`` streamed into a temporary file, fsynced, renamed to ``path``.

    Nothing of ``obj`` is copied in memory (as with DeepSpeed's own ``torch.save(obj, path)``):
    the tensors' bytes go from their storages to the file. The size in the error of a failed
    write is counted afterwards, by serialising ``obj`` again into a sink that keeps nothing.

    Args:
        obj: What ``torch.save`` writes (a checkpoint dict, a DeepSpeed rank's state).
        path: The final path; its folder is created if missing.
        **torch_save_kwargs: Passed to ``torch.save`` (``_use_new_zipfile_serialization``).

    Raises:
        CheckpointWriteError: The folder cannot be written or has no room; ``path`` is
            untouched and no temporary file remains.
    """
    _atomic_write(
        path,
        lambda f: torch.save(obj, f, **torch_save_kwargs),
        lambda: _saved_size(obj, torch_save_kwargs),
    )


def _is_local(filename: str) -> bool:
    return isinstance(filename, (str, os.PathLike)) and "://" not in str(filename)


def save_checkpoint_atomically(
    checkpoint, filename, file_client_args=None, backend_args=None
) -> None:
    """MMEngine's ``save_checkpoint``; local paths written by :func:`save_atomically`."""
    if _is_local(filename) and file_client_args is None and backend_args is None:
        save_atomically(checkpoint, str(filename))
    else:  # pavi://, petrel (s3://): their own backends
        _ORIGINAL["save_checkpoint"](checkpoint, filename, file_client_args, backend_args)


def _deepspeed_save(self, state_dict, path: str) -> None:
    """DeepSpeed ``TorchCheckpointEngine.save``, written whole or not at all."""
    save_atomically(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)


def _save_then_trim(self, runner, step, meta):
    """``CheckpointHook._save_checkpoint_with_step`` deleting old checkpoints after the save."""
    backend, deferred = self.file_backend, []
    backend.remove = lambda path: deferred.append((type(backend).remove, path))
    backend.rmtree = lambda path: deferred.append((type(backend).rmtree, path))
    try:
        _ORIGINAL["_save_checkpoint_with_step"](self, runner, step, meta)
    finally:
        del backend.remove, backend.rmtree  # back to the class's methods
    for remove, path in deferred:  # reached only when the new checkpoint is complete
        remove(backend, path)


def _warn_newer_incomplete(latest: str) -> None:
    """Warn about checkpoints beside ``latest`` with a higher number, all incomplete.

    A process killed while its checkpoint was written (a DeepSpeed folder with some ranks'
    files, a dead writer's temporary) never got to update ``last_checkpoint``: auto-resume
    takes ``latest`` and says which newer checkpoint it skipped and why.
    """
    named = checkpoint_number(latest)
    if not named:
        return
    folder = os.path.dirname(os.path.normpath(latest))
    for number, path in numbered_checkpoints(folder, named[0]):
        if number > named[1]:
            verdict = judge_checkpoint(path)
            if not verdict.complete:
                print_log(
                    f"xtuner-rope: auto-resume: skipped {verdict.path}, newer than {latest} but "
                    f"incomplete ({verdict.reason}): a run killed while writing it leaves "
                    f"such a checkpoint. Resuming from {latest}; the skipped one is "
                    "overwritten when training reaches it again.",
                    logger="current",
                    level=logging.WARNING,
                )


def find_latest_complete_checkpoint(path: str) -> str | None:
    """MMEngine's auto-resume finder, skipping an incomplete newest checkpoint (warned).

    Args:
        path: The work dir (``last_checkpoint`` is read there).

    Returns:
        What ``last_checkpoint`` names when complete; else the newest complete checkpoint in
        its folder; None when there is no ``last_checkpoint`` or nothing complete (a fresh start).
    """
    latest = _ORIGINAL["find_latest_checkpoint"](path)
    if latest is None or (latest and judge_checkpoint(latest).complete):
        if latest:
            refuse_other_world_size(latest)  # a ZeRO checkpoint of another world size
            _warn_newer_incomplete(latest)
        return latest
    verdict = judge_checkpoint(latest) if latest else None
    named = checkpoint_number(latest) if latest else None
    # A pointer cut short names no checkpoint: look in the work dir (MMEngine's default out_dir).
    folder = os.path.dirname(os.path.normpath(latest)) if named else path
    instead = newest_complete(folder, named[0] if named else "iter", exclude=latest or None)
    what = f"{latest} is incomplete ({verdict.reason})" if verdict else "it is empty"
    print_log(
        f"xtuner-rope: auto-resume: {os.path.join(path, 'last_checkpoint')} names a checkpoint "
        f"that cannot be resumed: {what}. "
        + (
            f"Resuming from the newest complete checkpoint, {instead}."
            if instead
            else "No complete checkpoint is there: training starts from the beginning."
        ),
        logger="current",
        level=logging.WARNING,
    )
    return instead


def _rebind(name: str, original, replacement) -> None:
    """Point every loaded module that imported ``original`` by name at ``replacement``."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is not None and namespace.get(name) is original:
            setattr(module, name, replacement)


def patch_checkpoint_writes() -> bool:
    """Crash-safe checkpoint writes and an auto-resume that skips incomplete checkpoints.

    Written against mmengine 0.10.6 (module docstring); DeepSpeed's writes are
    :func:`patch_deepspeed_checkpoint_writes`. Idempotent.

    Returns:
        True (the gap exists in every MMEngine 0.10 release).
    """
    import mmengine.runner._flexible_runner  # noqa: F401  (imports find_latest_checkpoint by name)
    import mmengine.runner.checkpoint as mm_checkpoint
    import mmengine.runner.runner  # noqa: F401  (imports both functions by name)
    from mmengine.hooks import CheckpointHook

    if "save_checkpoint" not in _ORIGINAL:
        _ORIGINAL["save_checkpoint"] = mm_checkpoint.save_checkpoint
        _ORIGINAL["find_latest_checkpoint"] = mm_checkpoint.find_latest_checkpoint
        _ORIGINAL["_save_checkpoint_with_step"] = CheckpointHook._save_checkpoint_with_step
    for name, replacement in (
        ("save_checkpoint", save_checkpoint_atomically),
        ("find_latest_checkpoint", find_latest_complete_checkpoint),
    ):
        _rebind(name, _ORIGINAL[name], replacement)
    CheckpointHook._save_checkpoint_with_step = _save_then_trim
    if refuse_incomplete not in _PATH_CHECKS:  # --resume / load_from of an incomplete checkpoint
        _PATH_CHECKS.append(refuse_incomplete)
    if refuse_other_world_size not in _RESUME_CHECKS:  # --resume of ZeRO on another world size
        _RESUME_CHECKS.append(refuse_other_world_size)
    return True


def patch_deepspeed_checkpoint_writes() -> bool:
    """DeepSpeed's rank files (``TorchCheckpointEngine.save``) written whole or not at all.

    Written against DeepSpeed 0.19.6, whose ``save`` is ``torch.save(state_dict, path)``
    straight to the final name; its record (``compat.records``) guards the DeepSpeed versions
    and probes ``TorchCheckpointEngine.save``, so a DeepSpeed that moves its checkpoint engine
    reports this patch skipped, not applied. Idempotent.

    Returns:
        True (the gap exists in every DeepSpeed release of the supported range).
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    TorchCheckpointEngine.save = _deepspeed_save
    return True


__all__ = [
    "CheckpointWriteError",
    "find_latest_complete_checkpoint",
    "patch_checkpoint_writes",
    "patch_deepspeed_checkpoint_writes",
    "save_atomically",
    "save_checkpoint_atomically",
    "write_atomically",
]
