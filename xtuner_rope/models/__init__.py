"""What is specific to one model family, a file per family: ``internlm2`` (+
``internlm2_kv_cache``), ``hf`` (+ ``hf_rope``: the transformers families), ``families`` (the
table, what is refused), ``rope_documents`` and ``rope_settings`` (length-dependent RoPE),
``dispatch`` (the entry point).
"""

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
