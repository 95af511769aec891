"""Which model families xtuner-rope serves, how, and which it refuses: one table.

``FAMILIES`` maps each served transformers family (4.48) to its classes and quirks
(:class:`Family`; ``interface`` ``"attention"`` through ``ALL_ATTENTION_FUNCTIONS``,
``"forward"`` where each backend is its own class, Qwen2-MoE). ``REFUSED`` names what cannot be
served by ``model_type``; :func:`checkpoint_verdict` reads ``config.json``. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint_config import read_checkpoint_config


@dataclass(frozen=True)
class Family:
    """One served transformers family.

    Attributes:
        name: What users call it (in messages and the README).
        model_types: ``config.json`` ``model_type`` values of its checkpoints.
        module: The transformers modeling module.
        attention: Attention class names (``interface="forward"``: the eager one first).
        rotary: Rotary class names (model-level).
        interface: ``"attention"`` or ``"forward"`` (the module docstring).
        interleaved: cos/sin interleave the frequencies (Cohere).
        fp32_apply: ``apply_rotary_pos_emb`` needs ``patch_hf_fp32_rotation``.
    """

    name: str
    model_types: tuple[str, ...]
    module: str
    attention: tuple[str, ...]
    rotary: tuple[str, ...]
    interface: str = "attention"
    interleaved: bool = False
    fp32_apply: bool = True


def _family(key: str, name: str, cls: str, **quirks) -> Family:
    return Family(
        name,
        (key,),
        f"transformers.models.{key}.modeling_{key}",
        (f"{cls}Attention",),
        (f"{cls}RotaryEmbedding",),
        **quirks,
    )


FAMILIES: dict[str, Family] = {
    "llama": _family("llama", "Llama (2/3; Yi, DeepSeek-coder)", "Llama"),
    "qwen2": _family("qwen2", "Qwen2 (2.5, 1.5)", "Qwen2"),
    "mistral": _family("mistral", "Mistral (Zephyr)", "Mistral"),
    "phi3": _family("phi3", "Phi-3", "Phi3"),
    "mixtral": _family("mixtral", "Mixtral", "Mixtral"),
    "gemma": _family("gemma", "Gemma", "Gemma"),
    "cohere": _family("cohere", "Cohere", "Cohere", interleaved=True, fp32_apply=False),
    "qwen2_moe": Family(
        "Qwen2-MoE (Qwen1.5-MoE)",
        ("qwen2_moe",),
        "transformers.models.qwen2_moe.modeling_qwen2_moe",
        ("Qwen2MoeAttention", "Qwen2MoeSdpaAttention", "Qwen2MoeFlashAttention2"),
        ("Qwen2MoeRotaryEmbedding",),
        interface="forward",
    ),
}

_REMOTE = (
    "its modeling code is a checkpoint's remote code that xtuner-rope has no integration "
    "for (its attention and rotary are not validated)"
)
UNSERVED_ADVICE = (
    "use a checkpoint of a served family, or train this one without xtuner-rope: "
    "remove `model_resource = dict(fn=enable_xtuner_rope)` and the xtuner_rope "
    "hooks/collate from the config, and train without packing "
    "(pack_to_max_length=False) or with XTuner's own varlen attention on a GPU "
    "with flash-attn"
)
# model_type -> (family, why not). InternLM2 is served by models/internlm2.py (not listed).
REFUSED: dict[str, tuple[str, str]] = {
    "gpt_bigcode": (
        "GPT-BigCode (StarCoder)",
        "it has no rotary position embedding (learned "
        "absolute positions), so there is no RoPE to validate and its attention "
        "has no document-isolating integration",
    ),
    "internlm": ("InternLM (1)", _REMOTE),
    "internlm3": ("InternLM3", _REMOTE),
    "baichuan": ("Baichuan / Baichuan2", _REMOTE),
    "chatglm": ("ChatGLM 2/3", _REMOTE),
    "minicpm": ("MiniCPM", _REMOTE),
    "minicpm3": ("MiniCPM3", _REMOTE),
    "qwen": ("Qwen (1)", _REMOTE),
    "deepseek_v2": ("DeepSeek-V2", _REMOTE),
}


def served_model_types() -> set[str]:
    """Every ``model_type`` xtuner-rope serves (InternLM2 included)."""
    return {t for f in FAMILIES.values() for t in f.model_types} | {"internlm2"}


def attention_classes() -> tuple[str, ...]:
    """Attention class names of every transformers family in ``FAMILIES``."""
    return tuple(c for f in FAMILIES.values() for c in f.attention)


def rotary_classes() -> tuple[str, ...]:
    """Rotary class names of every transformers family in ``FAMILIES``."""
    return tuple(c for f in FAMILIES.values() for c in f.rotary)


def family_of_class(class_name: str) -> Family | None:
    """The family whose attention or rotary class is named ``class_name``."""
    for family in FAMILIES.values():
        if class_name in family.attention + family.rotary:
            return family
    return None


def family_names() -> str:
    """``"Llama (...), Qwen2 (...), ..."`` for messages."""
    return ", ".join(f.name for f in FAMILIES.values())


def remote_code(auto_map: object) -> str:
    """The remote model class a checkpoint's ``auto_map`` names (``"modeling_x.XForCausalLM"``),
    the ``auto_map`` itself when it names none of the model classes, ``""`` without one."""
    if not isinstance(auto_map, dict):
        return ""
    for key in ("AutoModelForCausalLM", "AutoModel"):
        target = auto_map.get(key)
        if isinstance(target, (list, tuple)):
            target = target[0]
        if isinstance(target, str):
            return target
    return f"auto_map {auto_map}"


def checkpoint_verdict(path: object) -> tuple[str, str | None] | None:
    """What the local checkpoint at ``path`` (the LLM's ``pretrained_model_name_or_path``) says
    about serving it: None where ``config.json`` cannot be read or names no ``model_type``; else
    ``(description, None)`` for a served family, ``(description, refusal)`` for a refused one.
    """
    config = read_checkpoint_config(path)
    if config is None or config.data is None:
        return None
    model_type = str(config.get("model_type") or "").lower()
    if not model_type:
        return None
    where = (
        f"{config.source} (model_type {model_type!r}, architectures {config.get('architectures')})"
    )
    if model_type in served_model_types():
        return where, None
    family, why = REFUSED.get(model_type, (model_type, "xtuner-rope has no integration for it"))
    remote = remote_code(config.get("auto_map"))
    if remote and model_type not in REFUSED:
        why += f" (its modeling code is the checkpoint's own remote code: {remote})"
    return where, (
        f"{family} cannot be served by xtuner-rope: {why} (served: InternLM2, {family_names()})"
    )


# XTuner's own modeling packages (``xtuner.model.transformers_models``) -> model_type: the stock
# DeepSeek-V2 configs build ``DeepseekV2ForCausalLM.from_pretrained`` from there, not from the
# checkpoint, so the family is known from the config alone, before anything is downloaded.
XTUNER_MODEL_PACKAGES = {"xtuner.model.transformers_models.deepseek_v2": "deepseek_v2"}


def _import_error(package: str) -> str | None:
    """Why ``package`` does not import here (None when it does)."""
    import importlib

    try:
        importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return None


def model_class_verdict(class_path: object) -> tuple[str, str] | None:
    """The refusal of an LLM built from one of XTuner's own modeling packages (``class_path``: the
    config's ``llm`` ``type``): ``(description, refusal)`` naming the family and why, or None for
    any other class."""
    if not isinstance(class_path, str):
        return None
    package = next((p for p in XTUNER_MODEL_PACKAGES if class_path.startswith(p + ".")), None)
    if package is None:
        return None
    family, why = REFUSED[XTUNER_MODEL_PACKAGES[package]]
    broken = _import_error(package)
    if broken:
        why += (
            f"; besides, XTuner's bundled modeling package {package} does not import here "
            f"({broken})"
        )
    return (
        class_path,
        f"{family} cannot be served by xtuner-rope: {why} (served: InternLM2, {family_names()})",
    )
