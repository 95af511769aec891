"""Checkpoint files written whole or not at all: a temporary name, fsync, ``os.replace``.

MMEngine 0.10.6 and DeepSpeed 0.19.6 write checkpoints straight to their final name. A failed
:func:`save_atomically` raises :class:`CheckpointWriteError` naming the path, the bytes needed
and the free space, the previous checkpoints left as they were.
"""

from __future__ import annotations

import errno
import os
import shutil

import torch

from .complete import checkpoint_number, newest_complete


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
    """Delete the ``.name.<pid>.tmp`` that writers killed mid-write left in ``folder`` (no two
    processes write one checkpoint name at once, so any found is a dead writer's).
    """
    prefix = f".{name}."
    for entry in os.listdir(folder):
        if entry.startswith(prefix) and entry.endswith(".tmp"):
            try:
                os.remove(os.path.join(folder, entry))
            except OSError:  # gone already, or not ours to remove: the write goes on
                pass


class _Stream:
    """The temporary file as ``torch.save`` sees it: every write goes through :meth:`write`
    (without a ``fileno`` torch cannot write behind Python's back), so the disk's ``OSError`` is
    kept as raised (torch reports a failed write as ``RuntimeError``)."""

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
    """Write a file at ``path`` whole or not at all (temporary name, fsync, ``os.replace``; its
    folder created if missing): ``write`` writes the content to the temporary :class:`_Stream`;
    ``size``, called only when the write failed, gives the bytes it needs.

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
    """``torch.save(obj)`` streamed into a temporary file, fsynced, renamed to ``path`` (its folder
    created if missing); nothing of ``obj`` is copied in memory, and a failed write's size is
    counted afterwards into a sink that keeps nothing. ``torch_save_kwargs`` go to ``torch.save``.

    Raises:
        CheckpointWriteError: The folder cannot be written or has no room; ``path`` is
            untouched and no temporary file remains.
    """
    _atomic_write(
        path,
        lambda f: torch.save(obj, f, **torch_save_kwargs),
        lambda: _saved_size(obj, torch_save_kwargs),
    )


__all__ = ["CheckpointWriteError", "save_atomically"]
