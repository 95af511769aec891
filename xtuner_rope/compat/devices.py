"""Where the code runs: ``cpu_only`` (no accelerator MMEngine can drive), asked by most patches,
and what torch's CPU backend (gloo) can do there (``gloo_all_to_all_missing``)."""

from __future__ import annotations

import functools

import torch


def cpu_only() -> bool:
    """True where no accelerator MMEngine can drive (CUDA, NPU, MLU, MUSA) is present."""
    if torch.cuda.is_available():
        return False
    from mmengine.device import is_mlu_available, is_musa_available, is_npu_available

    return not (is_npu_available() or is_mlu_available() or is_musa_available())


@functools.cache
def gloo_all_to_all_missing() -> str | None:
    """Why torch's gloo backend cannot ``all_to_all`` here (XTuner's sequence parallel needs it;
    torch 2.4.1 lacks it), probed once on a one-rank in-memory group; None where it can or where
    the probe fails otherwise (the run will say).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return f"torch {torch.__version__} was built without torch.distributed's gloo backend"
    try:
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        sent, received = torch.arange(2.0), torch.zeros(2)
        group.alltoall([received], [sent]).wait()
    except RuntimeError as error:
        if "does not support alltoall" in str(error):
            return f"torch {torch.__version__}'s gloo backend has no all_to_all ({error})"
        return None
    return None
