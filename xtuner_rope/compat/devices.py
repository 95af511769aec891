"""Where the code runs: ``cpu_only`` (no accelerator MMEngine can drive), asked by most patches."""

from __future__ import annotations

import torch


def cpu_only() -> bool:
    """True where no accelerator MMEngine can drive (CUDA, NPU, MLU, MUSA) is present."""
    if torch.cuda.is_available():
        return False
    from mmengine.device import is_mlu_available, is_musa_available, is_npu_available

    return not (is_npu_available() or is_mlu_available() or is_musa_available())
