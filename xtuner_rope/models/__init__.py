"""What is specific to one model family: the transformers Llama/Qwen2/Mistral integration."""

from .hf import (
    HF_ATTENTION_CLASSES,
    PACKED_ATTENTION_KEY,
    integration_for,
    is_patched_hf_attention,
    patch_hf_model,
)
from .hf_rope import SUPPORTED_ROPE_TYPES, HFValidatedRotaryEmbedding

__all__ = [
    "HF_ATTENTION_CLASSES",
    "PACKED_ATTENTION_KEY",
    "SUPPORTED_ROPE_TYPES",
    "HFValidatedRotaryEmbedding",
    "integration_for",
    "is_patched_hf_attention",
    "patch_hf_model",
]
