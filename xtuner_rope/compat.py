"""Every patch xtuner-rope applies to a third-party package, in one place.

Each patch names the versions it was written against and the symptom it removes, and is
applied only where the gap exists: on a CUDA machine with a complete stack, ``apply()`` leaves
everything as it was. ``apply()`` is idempotent and runs when ``xtuner_rope`` is imported.
"""

from __future__ import annotations

import torch

_APPLIED: list[str] = []


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


def register_internlm2_auto_classes() -> bool:
    """Register XTuner's shipped InternLM2 classes with the ``transformers`` Auto factories.

    transformers 4.48 has no ``internlm2`` model type: real checkpoints carry remote code, and a
    locally built checkpoint without it cannot be loaded offline
    (``ValueError: The checkpoint you are trying to load has model type `internlm2` but
    Transformers does not recognize this architecture``). XTuner 0.2.0 ships the current
    InternLM2 code at ``xtuner._lite.modelings.internlm2``; registering it makes
    ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained(dir)`` work without remote code.

    Returns:
        True if the classes were registered now, False if ``internlm2`` was already known.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "internlm2" in CONFIG_MAPPING:
        return False
    from xtuner._lite.modelings.internlm2.configuration_internlm2 import InternLM2Config
    from xtuner._lite.modelings.internlm2.modeling_internlm2 import (
        InternLM2ForCausalLM,
        InternLM2Model,
    )

    AutoConfig.register("internlm2", InternLM2Config)
    AutoModel.register(InternLM2Config, InternLM2Model)
    AutoModelForCausalLM.register(InternLM2Config, InternLM2ForCausalLM)
    return True


def apply() -> list[str]:
    """Apply every patch whose gap exists here; safe to call any number of times.

    Returns:
        The names of the patches applied so far in this process.
    """
    for patch in (patch_torch_cpu_bf16_query, register_internlm2_auto_classes):
        if patch.__name__ not in _APPLIED and patch():
            _APPLIED.append(patch.__name__)
    return list(_APPLIED)
