"""Start-up findings of the model's family and attention (config and ``config.json``):
``flash_attention_2`` where flash-attn cannot run becomes ``"sdpa"`` (:func:`flash_attn_findings`);
a family xtuner-rope cannot serve is refused (:func:`model_family_findings`).
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.compat.mmengine_config import config_dict

from .fields import lazy_get as _get
from .fields import setter as _setitem
from .findings import Finding
from .startup import register_findings

__all__ = ["flash_attn_findings", "model_family_findings"]


@register_findings("attention")
def flash_attn_findings(cfg: Config) -> list[Finding]:
    """``attn_implementation="flash_attention_2"`` where flash-attn cannot run: use SDPA.

    Asked by ``model.llm.attn_implementation`` (transformers refuses to build) or, when the LLM
    dict sets none, by a local ``config.json`` (InternLM2 remote code imports flash-attn at the
    first forward). The packed attention isolates documents on every backend.
    """
    from transformers.utils import is_flash_attn_2_available

    llm = _get(_get(config_dict(cfg), "model"), "llm")
    if not isinstance(llm, dict) or is_flash_attn_2_available():
        return []
    source, asked = "", _get(llm, "attn_implementation")
    if asked is None:
        source, asked = _checkpoint_attn_implementation(cfg)
    if asked != "flash_attention_2":
        return []
    return [
        Finding(
            "model.llm.attn_implementation",
            f'"flash_attention_2"{source} needs flash-attn, which '
            "is not usable here (not installed, or no CUDA): the model would fail to build or to "
            "run",
            'set to "sdpa": xtuner-rope\'s packed attention isolates documents on every backend',
            _setitem(llm, "attn_implementation", "sdpa"),
        )
    ]


@register_findings("family")
def model_family_findings(cfg: Config) -> list[Finding]:
    """The LLM's family from its ``config.json``: refuse what xtuner-rope cannot serve
    (``models.families.REFUSED``).
    """
    from xtuner_rope.models.families import UNSERVED_ADVICE, checkpoint_verdict, model_class_verdict

    from .checkpoint_findings import llm_checkpoint_path

    llm = _get(_get(config_dict(cfg), "model"), "llm")
    setting, verdict = (
        "model.llm.type",
        model_class_verdict(getattr(_get(llm, "type"), "_module", None)),
    )  # XTuner's own DeepSeek-V2 package
    if verdict is None:
        setting = "model.llm.pretrained_model_name_or_path"
        verdict = checkpoint_verdict(llm_checkpoint_path(cfg))
    if verdict is None or verdict[1] is None:
        return []
    where, refusal = verdict
    return [Finding(setting, f"{where}: {refusal}", UNSERVED_ADVICE)]


def _checkpoint_attn_implementation(cfg: Config) -> tuple[str, object]:
    """``attn_implementation`` of the LLM's ``config.json`` (None when unreadable)."""
    from .checkpoint_findings import llm_checkpoint_config

    config = llm_checkpoint_config(cfg)
    if config is None or config.data is None:
        return "", None
    return f" (from {config.source})", config.get("attn_implementation")
