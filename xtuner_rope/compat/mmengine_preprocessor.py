"""MMEngine patch: the data preprocessor remembers the host tensor of each tensor it moves."""

from __future__ import annotations

import functools


def patch_mmengine_host_copies() -> bool:
    """Let a training forward read the collated batch on the host instead of the device.

    mmengine 0.10.x ``BaseDataPreprocessor.cast_data`` moves every tensor of the collated batch
    to the model's device (``data.to(device, non_blocking=...)``) and keeps nothing of the host
    tensor it came from: code in the forward that needs a batch value on the host (where the
    documents are, the positions' range) had to read the device back, a host sync in every
    step. The move is unchanged; each tensor it copies is recorded with its host tensor
    (``xtuner_rope.ops.host_copies.remember_host_copy``), which ``host_copy`` hands back.

    Returns:
        True if applied (mmengine's ``BaseDataPreprocessor`` has ``cast_data``).
    """
    try:
        from mmengine.model import BaseDataPreprocessor
    except ImportError:
        return False
    original = BaseDataPreprocessor.__dict__.get("cast_data")
    if original is None or getattr(original, "_xtuner_rope_host_copies", False):
        return False

    import torch

    from xtuner_rope.ops.host_copies import remember_host_copy

    @functools.wraps(original)
    def cast_data(self, data):
        out = original(self, data)  # containers recurse through this wrapper
        if isinstance(data, torch.Tensor) and isinstance(out, torch.Tensor):
            remember_host_copy(out, data)
        return out

    cast_data._xtuner_rope_host_copies = True
    BaseDataPreprocessor.cast_data = cast_data
    return True
