"""torch patch: ``torch.cpu.is_bf16_supported``, which XTuner assumes every device has."""

from __future__ import annotations

import torch


def _cpu_is_bf16_supported(including_emulation: bool = True) -> bool:
    """Stand-in for ``torch.cuda.is_bf16_supported`` on the ``torch.cpu`` namespace.

    Answers False so that XTuner's "auto" dtype logic keeps full fp32 on a CPU machine: CPU
    bf16 matmuls are emulated on most x86 parts (slower than fp32), and fp32 is what the
    tiny CPU recipes are tested with.
    """
    del including_emulation
    return False


def patch_torch_cpu_bf16_query() -> bool:
    """Give ``torch.cpu`` the ``is_bf16_supported`` that XTuner assumes every device has.

    xtuner 0.2.0 (``xtuner.utils.device.get_torch_device``) returns the ``torch.cpu`` module on
    a machine without CUDA/NPU, then calls ``.is_bf16_supported()`` on it in
    ``SupervisedFinetune._prepare_for_flash_attn`` and ``auto_dtype_of_deepspeed_config``.
    torch (checked 2.4 - 2.15) has no ``torch.cpu.is_bf16_supported``: every ``xtuner train``
    on CPU dies with ``AttributeError: module 'torch.cpu' has no attribute
    'is_bf16_supported'``.

    Returns:
        True if the patch was applied, False if torch already has the function.
    """
    if hasattr(torch.cpu, "is_bf16_supported"):
        return False
    torch.cpu.is_bf16_supported = _cpu_is_bf16_supported
    return True
