"""Start-up findings of XTuner's InternVL configs (``model.type=InternVL_V1_5``).

Fixed through ``compat.xtuner_internvl.INTERNVL_LOAD`` (logged): ``flash_attention_2`` where
flash-attn cannot run, bf16 on a CPU-only machine; ``internvl_collate_fn`` rows raised to the
dataset's ``max_length``. Refused: the LLaVA or text collate function, 4-bit quantization on a
CPU-only machine, an LLM that ``InternVL_V1_5_Dataset`` cannot template (InternLM2, Phi-3 only).
"""

from __future__ import annotations

from pathlib import Path

import torch
from mmengine.config import Config

from xtuner_rope.compat.devices import cpu_only
from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.compat.xtuner_internvl import INTERNVL_LOAD

from .fields import lazy_get as _get
from .fields import type_name
from .findings import Finding
from .startup import register_findings

__all__ = ["checkpoint_config", "internvl_findings", "is_internvl"]

SERVED_LLMS = ("InternLM2ForCausalLM", "Phi3ForCausalLM")


def is_internvl(cfg: Config) -> bool:
    """True if the config's model is XTuner's ``InternVL_V1_5``."""
    return type_name(_get(_get(config_dict(cfg), "model"), "type")) == "InternVL_V1_5"


def checkpoint_config(cfg: Config) -> tuple[dict | None, str]:
    """The InternVL checkpoint's ``config.json`` (None for a hub id) and its path."""
    from xtuner_rope.models.checkpoint_config import read_checkpoint_config

    path = _get(_get(config_dict(cfg), "model"), "model_path")
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return None, str(path)  # a hub id: XTuner's own loading reads it
    config = read_checkpoint_config(path)
    return config.data, config.source or str(path)


def _set_load(key: str, value: object):
    return lambda: INTERNVL_LOAD.__setitem__(key, value)


def _attention_finding(llm_config: dict) -> list[Finding]:
    from transformers.utils import is_flash_attn_2_available

    attn = "eager" if llm_config.get("model_type") == "internlm2" else "sdpa"
    if is_flash_attn_2_available() or INTERNVL_LOAD.get("attn_implementation") == attn:
        return []  # (or fixed already for this LLM: the re-check before the first step)
    return [
        Finding(
            "model (InternVL_V1_5)",
            'XTuner loads the LLM with attn_implementation="flash_attention_2", which needs '
            "flash-attn, not usable here (not installed, or no CUDA): the model would fail to "
            "build or to run",
            f'its LLM is loaded with "{attn}" (xtuner-rope\'s attention isolates samples on '
            "every backend)",
            _set_load("attn_implementation", attn),
        )
    ]


def _quantization_findings(model: dict) -> list[Finding]:
    if not cpu_only():
        return []
    return [
        Finding(
            f"model.{key}",
            "True on this CPU-only machine: bitsandbytes' 4-bit layers need a GPU",
            f"set {key}=False (LoRA on full-precision weights) or train on a GPU",
        )
        for key in ("quantization_llm", "quantization_vit")
        if _get(model, key)
    ]


def _llm_finding(config: dict | None, where: str) -> list[Finding]:
    architecture = ((config or {}).get("llm_config", {}).get("architectures") or ["?"])[0]
    if config is None or architecture in SERVED_LLMS:
        return []
    return [
        Finding(
            "model.model_path",
            f"{where}: llm_config.architectures[0] = {architecture!r}; XTuner's "
            "InternVL_V1_5_Dataset templates only InternLM2ForCausalLM and Phi3ForCausalLM "
            "(NotImplementedError after the model loaded)",
            "use an InternVL checkpoint with an InternLM2 or Phi-3 LLM",
        )
    ]


def _collate_findings(cfg: Config) -> list[Finding]:
    """The collate function of an InternVL config: XTuner's, or ``internvl_collate_fn`` with
    rows that hold the dataset's longest sample; the LLaVA/text collators do not fit."""
    loader = _get(config_dict(cfg), "train_dataloader")
    collate = _get(loader, "collate_fn")
    name = type_name(_get(collate, "type"))
    if name in ("llava_collate_fn", "rope_collate_fn"):
        return [
            Finding(
                "train_dataloader.collate_fn",
                f"{name} on InternVL samples: their images are <IMG_CONTEXT> tokens and tile "
                "stacks, not LLaVA's placeholder or text rows",
                "use internvl_collate_fn (from xtuner_rope import internvl_collate_fn) with "
                "max_length set to the dataset's",
            )
        ]
    longest = _get(_get(loader, "dataset"), "max_length")
    if name != "internvl_collate_fn" or not isinstance(longest, int):
        return []
    rows = _get(collate, "max_length")
    if isinstance(rows, int) and rows >= longest:
        return []
    return [
        Finding(
            "train_dataloader.collate_fn.max_length",
            f"{rows!r}, under the dataset's max_length={longest}: a sample the dataset keeps "
            "would not fit a row and the collate function would refuse its batch",
            f"set to {longest} (a row holds at least the longest sample)",
            lambda: collate.__setitem__("max_length", longest),
        )
    ]


@register_findings("internvl")
def internvl_findings(cfg: Config) -> list[Finding]:
    """What an ``InternVL_V1_5`` config needs for xtuner-rope; nothing for other configs."""
    if not is_internvl(cfg):
        return []
    model = _get(config_dict(cfg), "model")
    config, where = checkpoint_config(cfg)
    findings = _quantization_findings(model) + _llm_finding(config, where) + _collate_findings(cfg)
    findings += _attention_finding((config or {}).get("llm_config", {}))
    if cpu_only() and INTERNVL_LOAD.get("torch_dtype") != torch.float32:
        findings.append(
            Finding(
                "model (InternVL_V1_5)",
                "XTuner loads the checkpoint in bfloat16 on this CPU-only machine (the "
                "config's fp32 OptimWrapper would train bf16 weights)",
                "loaded in float32 (a GPU run keeps XTuner's bfloat16)",
                _set_load("torch_dtype", torch.float32),
            )
        )
    return findings
