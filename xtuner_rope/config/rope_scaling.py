"""Start-up check of the checkpoint's RoPE scaling, before any weight loads.

Length-dependent RoPE is served per packed document; what no model can compute is refused from
the checkpoint's ``config.json``: a ``rope_scaling`` type the family does not know, or one
lacking the fields its frequencies need (``models.rope_settings``).
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.models.rope_settings import checkpoint_rope

from .checkpoint_findings import llm_checkpoint_path
from .findings import Finding
from .startup import register_findings

__all__ = ["rope_scaling_findings"]


@register_findings("rope_scaling")
def rope_scaling_findings(cfg: Config) -> list[Finding]:
    """Refuse a checkpoint whose ``rope_scaling`` cannot be computed (read from config.json)."""
    where, setting = checkpoint_rope(llm_checkpoint_path(cfg))  # the checkpoint that loads
    if setting is None or setting.refusal is None:
        return []
    return [
        Finding(
            "model.llm.pretrained_model_name_or_path",
            f"{where}: {setting.refusal}; the model would fail after its weights load",
            "fix rope_scaling in the checkpoint's config.json (a type the family computes, with "
            'its fields: e.g. {"type": "dynamic", "factor": 2.0}), or remove it',
        )
    ]
