"""Family dispatch: the one entry point of the hooks, the doctor and the check. ``patch_model``
patches whatever family the model is (``models.families.FAMILIES``), ``isolates_documents`` says
whether it is patched, ``unwrap_model`` / ``language_model`` reach the XTuner and the HF model
inside DDP / DeepSpeed wrappers.
"""

from __future__ import annotations

from torch import nn

from .families import family_of_class
from .hf import (
    HF_ATTENTION_CLASSES,
    HF_FAMILIES,
    integration_for,
    is_patched_hf_attention,
    patch_hf_model,
    rotation_modules,
)
from .hf_rope import HFValidatedRotaryEmbedding, patch_hf_fp32_rotation
from .internlm2 import (
    INTERNLM2_ATTENTION_CLASSES,
    internlm2_attention_forward,
    patch_internlm2_attention,
)
from .internlm2_rope import ValidatedRotaryEmbedding
from .internvl import internvl_chat_model
from .rope_documents import install_row_lengths

VALIDATED_ROTARIES = (ValidatedRotaryEmbedding, HFValidatedRotaryEmbedding)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The runner's model inside DDP / FSDP / DeepSpeed wrappers (``.module``; MMEngine's
    ``MMDeepSpeedEngineWrapper``, not a module, forwards ``.module`` to its engine's)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def language_model(model: nn.Module) -> nn.Module:
    """The HF causal LM: through the wrappers (``unwrap_model``), XTuner's ``.llm`` and
    ``InternVL_V1_5``'s ``.model.language_model``."""
    model = unwrap_model(model)
    chat = internvl_chat_model(model)
    return chat.language_model if chat is not None else getattr(model, "llm", model)


def isolates_documents(model: nn.Module) -> bool:
    """True if ``model`` has attention layers of a supported family, all carrying our patch."""
    layers = [
        m
        for m in model.modules()
        if type(m).__name__ in INTERNLM2_ATTENTION_CLASSES + HF_ATTENTION_CLASSES
    ]
    return bool(layers) and all(
        is_patched_hf_attention(m)
        or getattr(m.forward, "__func__", None) is internlm2_attention_forward
        for m in layers
    )


def patch_model(model: nn.Module, max_position: int | None = None) -> tuple[int, str]:
    """Patch ``model`` with the integration of its family; ``(layers patched, family name)``.

    Raises:
        ValueError: no supported family's attention layer in ``model``.
    """
    integration = integration_for(model)
    if integration == "internlm2":
        count = patch_internlm2_attention(model, max_position=max_position)
        install_row_lengths(model)  # padded rows: each its own length-dependent frequencies
        return count, "InternLM2"
    if integration == "hf":
        layers = [m for m in model.modules() if type(m).__name__ in HF_ATTENTION_CLASSES]
        count = patch_hf_model(model, max_position=max_position)
        install_row_lengths(model)
        for module_name, interleaved in rotation_modules(layers).items():
            patch_hf_fp32_rotation(module_name, interleaved)  # bf16/fp16 q/k rotate in fp32
        # The family's first (eager) class: "Qwen2Moe", not "Qwen2MoeSdpa".
        return count, family_of_class(type(layers[0]).__name__).attention[0].removesuffix(
            "Attention"
        )
    raise ValueError(
        f"ValidatedRoPEHook: {type(language_model(model)).__name__} has no attention layer "
        f"xtuner-rope can serve. Supported families: InternLM2 / InternLM2.5 (classes "
        f"{', '.join(INTERNLM2_ATTENTION_CLASSES)}), {HF_FAMILIES} (classes "
        f"{', '.join(HF_ATTENTION_CLASSES)}). Train this model without xtuner-rope."
    )
