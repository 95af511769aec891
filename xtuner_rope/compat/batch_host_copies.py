"""MMEngine and XTuner patches: what moves the batch to the device remembers its host copy.

Forward code reads the host copy (``ops.host_copies``): no host sync. Two places move the
batch: MMEngine's data preprocessor and XTuner's ``VarlenAttnArgsToMessageHubHook``.
"""

from __future__ import annotations

import functools

import torch

from xtuner_rope.ops.host_copies import remember_host_copy


def patch_mmengine_host_copies() -> bool:
    """The data preprocessor's move remembers each moved tensor's host tensor.

    mmengine 0.10.x ``BaseDataPreprocessor.cast_data`` keeps nothing of the host tensors it
    moves; each copy is now recorded (``remember_host_copy``) for ``ops.host_copies.host_copy``.
    """
    from mmengine.model import BaseDataPreprocessor

    original = BaseDataPreprocessor.cast_data

    @functools.wraps(original)
    def cast_data(self, data):
        out = original(self, data)  # containers recurse through this wrapper
        if isinstance(data, torch.Tensor) and isinstance(out, torch.Tensor):
            remember_host_copy(out, data)
        return out

    BaseDataPreprocessor.cast_data = cast_data
    return True


def _remembering(publish):
    """``VarlenAttnArgsToMessageHubHook.before_*_iter`` that remembers the published
    boundaries' host copy (the collate's ``cumulative_len``, before the hook moves it)."""

    @functools.wraps(publish)
    def before_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        data = data_batch.get("data") if isinstance(data_batch, dict) else None
        host = data.get("cumulative_len") if isinstance(data, dict) else None
        publish(self, runner, batch_idx, data_batch)
        if isinstance(host, (list, tuple)) and len(host) == 1 and torch.is_tensor(host[0]):
            from xtuner_rope.models import channel

            published = channel.read()[0]
            if torch.is_tensor(published):
                remember_host_copy(published, host[0])

    return before_iter


def patch_xtuner_varlen_hook_host_copies() -> bool:
    """XTuner's varlen hook remembers the host copy of the boundaries it publishes.

    xtuner 0.2.0 ``VarlenAttnArgsToMessageHubHook`` publishes ``cumulative_len[0].to(device)``,
    which the attention's plan had to read back every step; the host tensor is now recorded.
    """
    from xtuner.engine.hooks import VarlenAttnArgsToMessageHubHook as Hook

    for name in ("before_train_iter", "before_val_iter"):
        setattr(Hook, name, _remembering(getattr(Hook, name)))
    return True
