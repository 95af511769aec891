"""MMEngine's, XTuner's and DeepSpeed's checkpoint reads and writes routed through ``checkpoints``.

mmengine 0.10.6 and xtuner 0.2.0 load runner checkpoints without an allow-list, write them
straight to their final name (DeepSpeed 0.19.6 too), delete the oldest first and auto-resume
whatever ``last_checkpoint`` names: the patches hand each step to ``xtuner_rope.checkpoints``.
"""

from __future__ import annotations

import os
import sys

from ..checkpoints.atomic import save_atomically
from ..checkpoints.auto_resume import resume_from
from ..checkpoints.complete import refuse_incomplete
from ..checkpoints.loading import load_checkpoint
from ..checkpoints.world import refuse_other_world_size

_ORIGINAL: dict[str, object] = {}
# Checks a checkpoint path passes before the patched loaders unpickle it (each raises to refuse),
# and those only a resume passes (the seed, read first thing): added by the writes' patch.
PATH_CHECKS: list = []
RESUME_CHECKS: list = []


def _rebind(name: str, original, replacement) -> None:
    """Point every loaded module that imported ``original`` by name at ``replacement``."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is not None and namespace.get(name) is original:
            setattr(module, name, replacement)


def _load_from_local_checked(filename: str, map_location=None):
    """MMEngine's loader for local checkpoint paths, through ``load_checkpoint``."""
    filename = os.path.expanduser(filename)
    if not os.path.isfile(filename):
        raise FileNotFoundError(f"{filename} can not be found.")
    for check in PATH_CHECKS:
        check(filename)
    return load_checkpoint(filename, map_location)


def _seed_from_checkpoint(path: str) -> int:
    """XTuner's ``get_seed_from_checkpoint`` (a ``.pth`` file or a DeepSpeed folder), checked.

    ``xtuner train --resume`` reads it first thing: an incomplete checkpoint (and a ZeRO one
    of another number of processes) is refused here, before anything is built.
    """
    if os.path.exists(path):
        for check in PATH_CHECKS + RESUME_CHECKS:
            check(path)
    if os.path.isdir(path):
        from deepspeed.utils.zero_to_fp32 import get_model_state_files

        path = get_model_state_files(path)[0]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"Cannot find {path}")
    return load_checkpoint(path)["meta"]["seed"]


def patch_checkpoint_loading() -> bool:
    """Let ``xtuner train --resume`` and ``load_from`` load weights-only (needed from torch 2.6).

    mmengine 0.10.6 (``runner.checkpoint.load_from_local``) and xtuner 0.2.0
    (``tools.utils.get_seed_from_checkpoint``) load through ``checkpoints.loading.load_checkpoint``
    after the :data:`PATH_CHECKS` (on torch 2.4 and 2.5 too).
    """
    import xtuner.tools.utils as xtuner_tool_utils
    from mmengine.runner.checkpoint import CheckpointLoader

    CheckpointLoader.register_scheme(prefixes="", force=True)(_load_from_local_checked)
    # `xtuner/tools/train.py` (run as __main__) imported the function by name: rebind it there.
    original = xtuner_tool_utils.get_seed_from_checkpoint
    _rebind("get_seed_from_checkpoint", original, _seed_from_checkpoint)
    return True


def save_checkpoint_atomically(
    checkpoint, filename, file_client_args=None, backend_args=None
) -> None:
    """MMEngine's ``save_checkpoint``; local paths written by ``save_atomically``."""
    local = isinstance(filename, (str, os.PathLike)) and "://" not in str(filename)
    if local and file_client_args is None and backend_args is None:
        save_atomically(checkpoint, str(filename))
    else:  # pavi://, petrel (s3://): their own backends
        _ORIGINAL["save_checkpoint"](checkpoint, filename, file_client_args, backend_args)


def find_latest_complete_checkpoint(path: str) -> str | None:
    """MMEngine's auto-resume finder, skipping an incomplete newest checkpoint (``resume_from``)."""
    return resume_from(_ORIGINAL["find_latest_checkpoint"](path), path)


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


def patch_checkpoint_writes() -> bool:
    """Crash-safe checkpoint writes and an auto-resume that skips incomplete checkpoints.

    mmengine 0.10.6's ``save_checkpoint`` (local paths) writes through ``save_atomically``;
    ``CheckpointHook`` deletes the checkpoint beyond ``max_keep_ckpts`` after the new one is
    complete; ``find_latest_checkpoint`` resumes complete checkpoints only; ``--resume`` and
    ``load_from`` refuse an incomplete checkpoint, ``--resume`` a ZeRO one of another world size.
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
    if refuse_incomplete not in PATH_CHECKS:
        PATH_CHECKS.append(refuse_incomplete)
    if refuse_other_world_size not in RESUME_CHECKS:
        RESUME_CHECKS.append(refuse_other_world_size)
    return True


def _deepspeed_save(self, state_dict, path: str) -> None:
    """DeepSpeed ``TorchCheckpointEngine.save``, written whole or not at all."""
    save_atomically(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)


def patch_deepspeed_checkpoint_writes() -> bool:
    """DeepSpeed 0.19.6's rank files (``TorchCheckpointEngine.save``) written whole or not at all."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    TorchCheckpointEngine.save = _deepspeed_save
    return True


__all__ = [
    "find_latest_complete_checkpoint",
    "patch_checkpoint_loading",
    "patch_checkpoint_writes",
    "patch_deepspeed_checkpoint_writes",
    "save_checkpoint_atomically",
]
