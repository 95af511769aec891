"""torch patch: ``torch.cpu.is_bf16_supported``, which XTuner assumes every device has."""

from __future__ import annotations

import torch


def _cpu_is_bf16_supported(including_emulation: bool = True) -> bool:
    """``is_bf16_supported`` for ``torch.cpu``: False, so XTuner's "auto" dtype keeps fp32 on a CPU
    (emulated bf16 is slower, and fp32 is what the CPU recipes are tested with).
    """
    del including_emulation
    return False


def patch_torch_cpu_bf16_query() -> bool:
    """Give ``torch.cpu`` the ``is_bf16_supported`` that XTuner assumes every device has.

    xtuner 0.2.0 calls ``get_torch_device().is_bf16_supported()``, which is ``torch.cpu`` on a
    machine without an accelerator; torch (2.4 - 2.15) has none there (``AttributeError``).
    """
    if hasattr(torch.cpu, "is_bf16_supported"):
        return False
    torch.cpu.is_bf16_supported = _cpu_is_bf16_supported
    return True
