"""What is specific to one model family, a file per family (docs/architecture.md lists them);
``dispatch`` is the entry point."""

from .hf import (
    HF_ATTENTION_CLASSES,
    PACKED_ATTENTION_KEY,
    integration_for,
    is_patched_hf_attention,
    patch_hf_model,
)
from .hf_rope import SUPPORTED_ROPE_TYPES, HFValidatedRotaryEmbedding
from .internlm2 import INTERNLM2_ATTENTION_CLASSES, patch_internlm2_attention

__all__ = [
    "HF_ATTENTION_CLASSES",
    "INTERNLM2_ATTENTION_CLASSES",
    "PACKED_ATTENTION_KEY",
    "SUPPORTED_ROPE_TYPES",
    "HFValidatedRotaryEmbedding",
    "integration_for",
    "is_patched_hf_attention",
    "patch_hf_model",
    "patch_internlm2_attention",
]
