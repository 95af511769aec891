"""``xtuner-rope convert pth_to_hf`` of XTuner's ``InternVL_V1_5``: the official layout, exact.

XTuner's ``convert_to_official.py`` merges LoRA in bf16, saves no remote code and keeps a
forced ``flash_attention_2``; here: fp32, eager attention, the checkpoint's config, remote code
and tokenizer.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from . import convert_dtype

INTERNVL_MODEL = "InternVL_V1_5"
# Config entries that name the weights' dtype (top level and the two sub-models').
DTYPE_KEY = "torch_dtype"
SUB_CONFIGS = ("llm_config", "vision_config")


def is_internvl(model_cfg: dict) -> bool:
    """True if a config's ``model`` is XTuner's ``InternVL_V1_5`` (by name or class)."""
    kind = model_cfg.get("type")
    return getattr(kind, "__name__", kind) == INTERNVL_MODEL


def build_trained(model_cfg: dict, checkpoint: str) -> torch.nn.Module:
    """``model_cfg``'s ``InternVL_V1_5`` in fp32, eager attention, eval mode, LoRA unmerged,
    holding ``checkpoint``'s weights (``iter_N.pth``, file or DeepSpeed folder).

    Raises:
        ValueError: the checkpoint holds weights the config's model does not have.
    """
    from mmengine.config import ConfigDict
    from xtuner.model.utils import LoadWoInit, guess_load_checkpoint
    from xtuner.registry import BUILDER

    from xtuner_rope.compat.xtuner_internvl import INTERNVL_LOAD

    # The script's settings: no pretrained_pth read at build time, no 4-bit base.
    built = ConfigDict({**model_cfg, "pretrained_pth": None})
    built.update(quantization_vit=False, quantization_llm=False)
    kept = dict(INTERNVL_LOAD)
    INTERNVL_LOAD.update(torch_dtype=torch.float32, attn_implementation="eager")
    try:
        with LoadWoInit():
            model = BUILDER.build(built)
    finally:
        INTERNVL_LOAD.clear()
        INTERNVL_LOAD.update(kept)
    state = guess_load_checkpoint(checkpoint)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(
            f"xtuner-rope convert pth_to_hf: {checkpoint} holds {len(unexpected)} weight(s) the "
            f"config's {INTERNVL_MODEL} does not have (first: {sorted(unexpected)[0]}): it was "
            "trained from another config (LoRA or not, another model path). Convert it with the "
            "config of its run (the copy in its work_dir)."
        )
    assert not set(state) & set(missing)  # every weight of the checkpoint was loaded
    return model.float().eval()


def merged_chat_model(model: torch.nn.Module) -> torch.nn.Module:
    """The hub chat model inside XTuner's ``InternVL_V1_5``, its LoRA adapters merged (fp32)."""
    chat = model.model
    if model.use_visual_encoder_lora:
        chat.vision_model = chat.vision_model.merge_and_unload()
    if model.use_llm_lora:
        chat.language_model = chat.language_model.merge_and_unload()
    return chat


def write_official_files(model_path: str, save_dir: Path, dtype: torch.dtype) -> None:
    """The checkpoint's ``config.json`` (``torch_dtype`` set), remote code and tokenizer, saved."""
    from transformers import AutoTokenizer

    from xtuner_rope.models.checkpoint_config import read_checkpoint_config

    source = Path(model_path)
    read = read_checkpoint_config(model_path)
    if read.data is None:
        raise ValueError(
            f"convert pth_to_hf: cannot copy the InternVL checkpoint's config: {read.problem}; "
            "point the config's path at the InternVL checkpoint the run started from."
        )
    config = copy.deepcopy(read.data)
    name = str(dtype).removeprefix("torch.")
    for entry in (config, *(config.get(key) or {} for key in SUB_CONFIGS)):
        if DTYPE_KEY in entry or entry is config:
            entry[DTYPE_KEY] = name
    (save_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for code in source.glob("*.py"):
        shutil.copyfile(code, save_dir / code.name)
    AutoTokenizer.from_pretrained(model_path, trust_remote_code=True).save_pretrained(save_dir)


def convert_internvl(
    model_cfg: dict, checkpoint: str, save_dir: str, dtype: torch.dtype, max_shard_size: str
) -> None:
    """Convert an ``InternVL_V1_5`` checkpoint (``iter_N.pth``) to the official InternVL layout
    under ``save_dir``, in ``dtype`` (the cast's losses printed; fp32: bit for bit)."""
    chat = merged_chat_model(build_trained(model_cfg, checkpoint))
    print(convert_dtype.describe_cast(convert_dtype.cast_module(chat, dtype), dtype))
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    chat.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    write_official_files(model_cfg["model_path"], out, dtype)
    print(f"xtuner-rope convert: {INTERNVL_MODEL} saved in the official InternVL layout to {out}.")


__all__ = [
    "INTERNVL_MODEL",
    "is_internvl",
    "build_trained",
    "merged_chat_model",
    "write_official_files",
    "convert_internvl",
]
