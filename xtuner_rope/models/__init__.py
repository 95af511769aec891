"""What is specific to one model family, a file per family.

``internlm2.py`` (+ ``internlm2_kv_cache.py``): InternLM2's fused ``wqkv`` attention, XTuner's and
remote-code classes by name, both KV-cache contracts. ``hf.py`` (+ ``hf_rope.py``): the
transformers families (Llama, Qwen2, Mistral, Phi-3, Mixtral, Gemma, Cohere, Qwen2-MoE) through
their attention interface (Qwen2-MoE: its layers' forward) and their model-level rotary.
``families.py``: the table of those families and their quirks, and what is refused (read from a
checkpoint's ``config.json`` before loading). ``rope_documents.py``: length-dependent RoPE
(dynamic NTK, LongRoPE) per packed document; ``rope_settings.py``: a checkpoint's RoPE read from
``config.json``.
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
