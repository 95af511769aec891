"""Load runner checkpoints with ``weights_only=True``: MMEngine's and XTuner's types allow-listed.

:func:`load_checkpoint` allows exactly the types runner checkpoints hold (torch >= 2.6 refuses
the message hub's), for its own call; any other is refused with its name.
``XTUNER_ROPE_TRUSTED_CHECKPOINTS`` (files or folders, ``os.pathsep``-separated) loads trusted
files in full. ``compat.runner_checkpoints`` routes MMEngine's and XTuner's loaders here.
"""

from __future__ import annotations

import _codecs
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch.torch_version import TorchVersion

TRUST_ENV = "XTUNER_ROPE_TRUSTED_CHECKPOINTS"


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A checkpoint names a type outside the allow-list and is not in ``TRUST_ENV``."""


def _history_buffer_getattr(owner, name: str):
    """``getattr`` as MMEngine's ``HistoryBuffer`` pickles need it (its public methods) and no
    more: a general ``getattr`` would let a file reach any attribute of what it can build.
    """
    from mmengine.logging import HistoryBuffer

    method = getattr(HistoryBuffer, name, None) if isinstance(name, str) else None
    if owner is not HistoryBuffer or name.startswith("_") or not callable(method):
        raise pickle.UnpicklingError(
            f"checkpoint asks for getattr({owner!r}, {name!r}); only public HistoryBuffer "
            "methods are allowed"
        )
    return method


def runner_checkpoint_globals() -> list:
    """The non-tensor globals MMEngine 0.10 / XTuner 0.2 runner checkpoints hold: those of the tiny
    recipes' real checkpoints, plain and under DeepSpeed (``get_unsafe_globals_in_checkpoint``)."""
    from mmengine.config import ConfigDict
    from mmengine.logging import HistoryBuffer

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    names = "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64"
    dtype_classes = [type(np.dtype(name)) for name in f"{names} complex64 complex128".split()]
    # ConfigDict and set: in DeepSpeed's model-states file (read for the seed on resume).
    return [
        HistoryBuffer,
        ConfigDict,
        set,
        (_history_buffer_getattr, "builtins.getattr"),
        (multiarray._reconstruct, f"{multiarray.__name__}._reconstruct"),
        (multiarray.scalar, f"{multiarray.__name__}.scalar"),
        np.ndarray,
        np.dtype,
        *dtype_classes,
    ]


def _named(entry):
    """An allow-list entry as torch < 2.6 takes it: an object, keyed by its module and name."""
    if not isinstance(entry, tuple):
        return entry
    obj, qualified = entry
    module, _, name = qualified.rpartition(".")

    def alias(*args, **kwargs):
        return obj(*args, **kwargs)

    alias.__module__, alias.__name__, alias.__qualname__ = module, name, name
    return alias


@contextmanager
def runner_globals_allowed() -> Iterator[None]:
    """:func:`runner_checkpoint_globals` allowed for ``weights_only`` loads inside the block.

    torch >= 2.6: ``safe_globals``. torch 2.4 / 2.5 have only the process-wide
    ``add_safe_globals`` keyed by an object's own name: each renamed entry becomes an alias with
    the name the pickle uses (plus ``_codecs.encode``), and the list is put back after the block.
    """
    entries = runner_checkpoint_globals()
    serialization = torch.serialization
    if TorchVersion(torch.__version__) >= (2, 6):  # a Version, not a string compare
        with serialization.safe_globals(entries):
            yield
        return
    before = list(serialization.get_safe_globals())
    # numpy pickles array bytes as `_codecs.encode(str, "latin1")`: torch 2.6 allows it by
    # default, 2.4 refuses it ("Unsupported global: GLOBAL _codecs.encode").
    serialization.add_safe_globals([_named(entry) for entry in entries] + [_codecs.encode])
    try:
        yield
    finally:
        serialization.clear_safe_globals()
        serialization.add_safe_globals(before)


def is_trusted(path: str) -> bool:
    """True if ``path`` is, or lies under, an entry of ``XTUNER_ROPE_TRUSTED_CHECKPOINTS``."""
    real = os.path.realpath(path)
    for entry in filter(None, os.environ.get(TRUST_ENV, "").split(os.pathsep)):
        trusted = os.path.realpath(os.path.expanduser(entry))
        if real == trusted or real.startswith(trusted.rstrip(os.sep) + os.sep):
            return True
    return False


def _what_is_refused(path: str, error: Exception) -> str:
    """The globals outside the allow-list, or the unpickler's reason, for the message."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # legacy (non-zip) file: read the unpickler's own message instead
        found = []
    text = str(error)
    found = found or re.findall(r"Unsupported global: GLOBAL (\S+)", text)
    if found:
        return (
            f"it names {', '.join(found)}, which runner checkpoints do not hold (allowed: "
            "tensors, containers, MMEngine's HistoryBuffer and ConfigDict, numpy "
            "arrays/scalars/dtypes)"
        )
    reason = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    return f"it fails the weights-only check ({reason.group(1) if reason else text.strip()})"


def _refusal(path: str, error: Exception) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"xtuner-rope refused to load {path}: {_what_is_refused(path, error)}. Unpickling "
        "anything else can run arbitrary code. If you trust this file (you wrote it, or know "
        f"where it comes from), set {TRUST_ENV}={path} (files or folders, separated by "
        f"'{os.pathsep}'); or, for a type that is safe to rebuild, call "
        "torch.serialization.add_safe_globals([...]) first."
    )


def load_checkpoint(path: str, map_location="cpu"):
    """``torch.load`` a runner checkpoint (``.pth`` or DeepSpeed ``*_model_states.pt``) with
    ``weights_only=True`` and the runner allow-list; ``map_location`` as for ``torch.load``.

    Raises:
        UntrustedCheckpointError: A type outside the allow-list, and the file is not trusted
            through ``XTUNER_ROPE_TRUSTED_CHECKPOINTS``.
    """
    if is_trusted(path):
        return torch.load(path, map_location=map_location, weights_only=False)
    with runner_globals_allowed():
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            # torch 2.4 reports a legacy file cut inside its storages as a weights-only
            # failure ("WeightsUnpickler error: unexpected EOF"): a cut file, not a refusal.
            if "unexpected EOF" in str(error):
                raise EOFError(f"{path} ends early: {error}") from error
            raise _refusal(path, error) from error
