"""A tiny InternVL checkpoint around a tiny InternLM2 or Phi-3 (InternViT, ``mlp1``, chat wrapper).

112 px tiles, 16 tokens a tile; ``python tools/make_tiny.py --family internvl2 --llm LLM_DIR
--out DIR`` runs it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from xtuner_rope.models.checkpoint_config import read_checkpoint_config

HUB_CODE = Path(__file__).with_name("internvl_hub")
# The hub's InternVL2 tokenizers add these; XTuner's dataset uses the first three.
SPECIAL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>"]
SPECIAL_TOKENS += ["<box>", "</box>"]
TINY_VIT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=112,
    patch_size=14,
    qkv_bias=True,
    qk_normalization=True,
    norm_type="rms_norm",
    use_flash_attn=False,
    drop_path_rate=0.0,
)
TEMPLATES = {"InternLM2ForCausalLM": "internlm2-chat", "Phi3ForCausalLM": "phi3-chat"}


def tokens_per_tile(config: dict) -> int:
    """LLM tokens one tile of an InternVL checkpoint's ``config`` (``config.json``, hub or tiny)
    becomes: ``(force_image_size / patch_size) ** 2 * ratio ** 2``."""
    side = config.get("force_image_size") or config["vision_config"]["image_size"]
    patch = config["vision_config"]["patch_size"]
    return int((side // patch) ** 2 * config["downsample_ratio"] ** 2)


def _copy_code(llm_dir: Path, out: Path) -> None:
    import xtuner._lite.modelings.internlm2 as internlm2
    import xtuner._lite.modelings.internvl2 as internvl2

    for name in ("configuration_internvl_chat.py", "modeling_internvl_chat.py"):
        shutil.copy(HUB_CODE / f"{name}.in", out / name)  # stored as .py.in: not package modules
    for name in ("configuration_intern_vit.py", "modeling_intern_vit.py"):
        shutil.copy(Path(internvl2.__file__).parent / name, out / name)
    # The wrapper imports InternLM2's code whatever the LLM (the hub's InternVL2-4B ships
    # Phi-3's instead): the LLM's own remote code where it has one, else XTuner's copy.
    for name in ("configuration_internlm2.py", "modeling_internlm2.py"):
        own = llm_dir / name
        shutil.copy(own if own.is_file() else Path(internlm2.__file__).parent / name, out / name)


def save_tiny_internvl(llm_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny InternVL checkpoint around the tiny InternLM2 or Phi-3 checkpoint ``llm_dir``
    (``seed``: the InternViT and ``mlp1`` weights); return ``out_dir``.

    Raises:
        ValueError: the LLM is neither InternLM2 nor Phi-3.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    llm_dir, out = Path(llm_dir), Path(out_dir)
    read = read_checkpoint_config(str(llm_dir))
    if read is None or read.data is None:
        raise ValueError(f"save_tiny_internvl: {llm_dir}: {read.problem if read else 'no path'}")
    llm_config = read.data
    architecture = (llm_config.get("architectures") or ["?"])[0]
    if architecture not in TEMPLATES:
        raise ValueError(
            f"save_tiny_internvl: {llm_dir}/config.json: architectures[0] = {architecture!r}; "
            f"expected one of {sorted(TEMPLATES)} (XTuner's InternVL_V1_5_Dataset serves only "
            "these). Build one with tools/make_tiny.py --family internlm2|phi3."
        )
    out.mkdir(parents=True, exist_ok=True)
    _copy_code(llm_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir, trust_remote_code=True)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.save_pretrained(out)
    llm = AutoModelForCausalLM.from_pretrained(
        llm_dir, trust_remote_code=True, torch_dtype=torch.float32
    )
    if llm.get_input_embeddings().num_embeddings < len(tokenizer):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            llm.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=16)
    config = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "auto_map": {
            "AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
            "AutoModel": "modeling_internvl_chat.InternVLChatModel",
            "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel",
        },
        "vision_config": {**TINY_VIT, "architectures": ["InternVisionModel"]},
        "llm_config": {**llm.config.to_dict(), "architectures": [architecture]},
        "template": TEMPLATES[architecture],
        "downsample_ratio": 0.5,
        "force_image_size": TINY_VIT["image_size"],
        "select_layer": -1,
        "dynamic_image_size": True,
        "use_thumbnail": True,
        "min_dynamic_patch": 1,
        "max_dynamic_patch": 2,
        "ps_version": "v2",
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    chat_config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    chat_class = get_class_from_dynamic_module("modeling_internvl_chat.InternVLChatModel", out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = chat_class(chat_config, language_model=llm)
    model.save_pretrained(out, safe_serialization=True)
    saved = dict(read_checkpoint_config(str(out)).data)
    for key in ("_commit_hash", "_name_or_path"):
        saved.pop(key, None)
    (out / "config.json").write_text(
        json.dumps({**saved, "auto_map": config["auto_map"]}, indent=2)
    )
    return out
