"""Start-up findings of XTuner's LLaVA configs (InternVL's: ``config.internvl``).

On a CPU-only machine the stock fp16 LLM is loaded in fp32 (logged); XTuner's
``EvaluateChatHook`` with ``evaluation_images`` is kept (``compat.transformers_internlm2``).
"""

from __future__ import annotations

import torch
from mmengine.config import Config

from xtuner_rope.compat.devices import cpu_only
from xtuner_rope.compat.mmengine_config import config_dict

from .fields import lazy_get as _get
from .fields import type_name
from .findings import Finding
from .startup import register_findings

__all__ = ["is_llava", "multimodal_findings"]

HALF_DTYPES = ("torch.float16", "torch.bfloat16", "float16", "bfloat16")


def is_llava(cfg: Config) -> bool:
    """True if the config's model is XTuner's ``LLaVAModel``."""
    return type_name(_get(_get(config_dict(cfg), "model"), "type")) == "LLaVAModel"


def _dtype_name(value: object) -> str:
    return str(value) if not isinstance(value, torch.dtype) else f"{value}"


def _half_llm_findings(llm: dict) -> list[Finding]:
    dtype = _get(llm, "torch_dtype")
    if (
        not cpu_only()
        or _dtype_name(dtype) not in HALF_DTYPES
        or _get(llm, "quantization_config") is not None
    ):
        return []
    return [
        Finding(
            "model.llm.torch_dtype",
            f"{_dtype_name(dtype)} on this CPU-only machine: torch's CPU "
            "matmuls refuse the mixed fp16/fp32 inputs of the LLaVA projector and LLM",
            'set to "float32" (the LLM is loaded in full precision on CPU; a GPU run keeps the '
            "config's dtype)",
            lambda: llm.__setitem__("torch_dtype", "float32"),
        )
    ]


@register_findings("multimodal")
def multimodal_findings(cfg: Config) -> list[Finding]:
    """What a multimodal config must change for xtuner-rope; nothing for a text config."""
    model = _get(config_dict(cfg), "model")
    name = type_name(_get(model, "type"))
    if name != "LLaVAModel":
        return []
    llm = _get(model, "llm")
    findings = _half_llm_findings(llm) if isinstance(llm, dict) else []
    return findings
