"""MMEngine patches for a CPU-only machine: process-group start (gloo) and DDP without ``device_ids``."""

from __future__ import annotations

import functools

import torch


def _init_dist_pytorch_cpu(backend: str, init_backend: str = "torch", **kwargs) -> None:
    """mmengine 0.10.6's ``_init_dist_pytorch`` for a CPU-only machine.

    Same steps minus ``torch.cuda.set_device(local_rank)``, and NCCL (which needs GPUs)
    replaced by gloo, the backend torch ships for CPU tensors.
    """
    if backend == "nccl":
        backend = "gloo"
    if init_backend == "torch":
        torch.distributed.init_process_group(backend=backend, **kwargs)
    elif init_backend == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, **kwargs)
    else:
        raise ValueError(
            f"xtuner_rope.compat: init_backend {init_backend!r} is not supported on "
            "a CPU-only machine; use 'torch' (DDP) or 'deepspeed'."
        )


def patch_mmengine_dist_init_on_cpu() -> bool:
    """Let ``--launcher pytorch`` start a process group on a CPU-only machine.

    mmengine 0.10.6 ``_init_dist_pytorch`` calls ``torch.cuda.set_device`` ("Found no NVIDIA
    driver") and XTuner configs ask for NCCL; ``init_dist`` looks the function up at call time.
    """
    import mmengine.dist.utils as dist_utils

    dist_utils._init_dist_pytorch = _init_dist_pytorch_cpu
    return True


def patch_mmengine_ddp_device_ids_on_cpu() -> bool:
    """Wrap CPU models in DDP without ``device_ids`` on a CPU-only machine: mmengine 0.10.6
    ``Runner.wrap_model`` passes ``device_ids=[LOCAL_RANK]``, which DDP refuses for a CPU module.
    """
    from mmengine.model import MMDistributedDataParallel

    original_init = MMDistributedDataParallel.__init__

    @functools.wraps(original_init)
    def init_without_device_ids(self, module, detect_anomalous_params=False, **kwargs):
        kwargs["device_ids"] = None
        kwargs["output_device"] = None
        original_init(self, module, detect_anomalous_params, **kwargs)

    MMDistributedDataParallel.__init__ = init_without_device_ids
    return True
