"""Start-up finding: the LLM's checkpoint must have a ``config.json`` the start-up can read.

The start-up judges the model from it before a weight loads. Where it cannot be read (a hub id
offline, a path missing, no ``config.json``) the start-up and the doctor name the path, why and
what to do. Only ``model.llm`` is read; an LLM of XTuner's own modeling packages is judged by
its class (``models.families.model_class_verdict``).
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.compat.xtuner_model_resource import config_being_started
from xtuner_rope.models.checkpoint_config import CheckpointConfig, read_checkpoint_config
from xtuner_rope.models.families import model_class_verdict

from .fields import lazy_get as _get
from .findings import Finding
from .startup import register_findings

__all__ = [
    "checkpoint_config_findings",
    "is_unreadable_checkpoint",
    "llm_checkpoint_config",
    "llm_checkpoint_path",
]

SETTING = "model.llm.pretrained_model_name_or_path"
CANNOT_READ = "its config.json cannot be read"


def llm_checkpoint_path(cfg: Config) -> object:
    """The checkpoint XTuner will load the LLM from: ``model.llm.pretrained_model_name_or_path``;
    while ``set_model_resource`` starts ``cfg``, the top-level setting (XTuner writes it into every
    nested path right after). None without a ``model.llm`` dict.
    """
    llm = _get(_get(config_dict(cfg), "model"), "llm")
    if not isinstance(llm, dict):
        return None
    top = _get(config_dict(cfg), "pretrained_model_name_or_path")
    if isinstance(top, str) and config_being_started() is cfg:
        return top
    return _get(llm, "pretrained_model_name_or_path")


def llm_checkpoint_config(cfg: Config) -> CheckpointConfig | None:
    """The ``config.json`` of the LLM's checkpoint (:func:`llm_checkpoint_path`), or None when
    the config names no path. Every start-up finding that needs it reads it here."""
    return read_checkpoint_config(llm_checkpoint_path(cfg))


def _advice(name: str, hub: bool) -> str:
    """What to do about an unreadable checkpoint ``name``."""
    if hub:
        return (
            f"if {name} is meant as a local directory, put the checkpoint there (config.json, "
            f"tokenizer, weights); as a hub id, download it where the hub can be reached "
            f"(`huggingface-cli download {name} --local-dir <dir>`) and set "
            "pretrained_model_name_or_path in PART 1 of the config to <dir>"
        )
    return (
        "set pretrained_model_name_or_path in PART 1 of the config to a Hugging Face "
        "checkpoint directory (config.json, tokenizer and weights) or a hub id"
    )


def is_unreadable_checkpoint(finding: Finding) -> bool:
    """``finding`` is this module's refusal (the LLM's ``config.json`` cannot be read)."""
    return finding.fix is None and finding.setting == SETTING and CANNOT_READ in finding.problem


@register_findings("llm_checkpoint")
def checkpoint_config_findings(cfg: Config) -> list[Finding]:
    """Refuse an LLM whose ``config.json`` cannot be read, before anything loads.

    Returns:
        One conflict naming the path, why and what to do; empty when it can be read, when the
        LLM names no path, or when it is built from one of XTuner's own modeling packages.
    """
    llm = _get(_get(config_dict(cfg), "model"), "llm")
    if model_class_verdict(getattr(_get(llm, "type"), "_module", None)) is not None:
        return []  # refused by its class (model_family_findings), whatever its checkpoint
    config = llm_checkpoint_config(cfg)  # None without a model.llm dict (InternVL)
    if config is None or config.data is not None:
        return []
    return [
        Finding(
            SETTING,
            f"{config.name!r}: {CANNOT_READ}: {config.problem}. Nothing of "
            "the model is known before its weights would load (family, attention, RoPE), and "
            "XTuner would stop on the same path later, in a traceback of the hub client",
            _advice(config.name, config.hub),
        )
    ]
