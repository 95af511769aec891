"""A checkpoint's RoPE setting, read from its ``config.json`` before anything loads.

For the start-up (``config.rope_scaling``) and the doctor (``doctor.rope``): up to which length
the frequencies do not depend on it, and what cannot be served. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from .families import FAMILIES

__all__ = ["RopeSetting", "checkpoint_rope", "rope_setting"]

HF_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
INTERNLM2_ROPE_TYPES = ("linear", "dynamic")
# Fields each rope_type's frequencies need (transformers 4.48 / InternLM2's _init_rope).
REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor"),
}
# Families whose 4.48 rotary switches LongRoPE factors per call (`_longrope_frequency_update`).
LONGROPE_PER_CALL = ("phi3",)


@dataclass(frozen=True)
class RopeSetting:
    """The RoPE of one checkpoint, as ``config.json`` gives it.

    Attributes:
        model_type: ``config.json`` ``model_type``.
        rope_type: ``default`` or the ``rope_scaling`` type (``su`` read as ``longrope``).
        threshold: The longest length whose frequencies do not depend on it; None when they
            never do.
        refusal: Why it cannot be served (None when it can).
    """

    model_type: str
    rope_type: str
    threshold: int | None
    refusal: str | None = None

    @property
    def length_dependent(self) -> bool:
        return self.threshold is not None


def rope_setting(config: dict) -> RopeSetting | None:
    """The setting of a ``config.json`` dict; None for a family xtuner-rope does not serve."""
    model_type = config.get("model_type")
    served = model_type == "internlm2" or any(
        model_type in f.model_types for f in FAMILIES.values()
    )
    if not served:
        return None
    scaling = config.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        return RopeSetting(model_type, "?", None, f"rope_scaling {scaling!r} is not a dict")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):  # Phi3Config reads them as longrope
        rope_type = "longrope"
    known = INTERNLM2_ROPE_TYPES + ("default",) if model_type == "internlm2" else HF_ROPE_TYPES
    if rope_type not in known:
        return RopeSetting(
            model_type,
            str(rope_type),
            None,
            f"rope_scaling type {rope_type!r} is not one {model_type} computes "
            f"(known: {', '.join(known)})",
        )
    fields = dict(scaling, original_max_position_embeddings=_original(config, scaling))
    missing = [k for k in REQUIRED.get(rope_type, ()) if fields.get(k) is None]
    if rope_type == "longrope" and not (
        config.get("original_max_position_embeddings") or scaling.get("factor")
    ):
        missing.append("original_max_position_embeddings (or rope_scaling factor)")
    if missing:
        return RopeSetting(
            model_type,
            rope_type,
            None,
            f"rope_scaling type {rope_type!r} lacks {', '.join(missing)}, which its "
            "frequencies need",
        )
    return RopeSetting(model_type, rope_type, _threshold(model_type, rope_type, config))


def _original(config: dict, scaling: dict) -> object:
    return scaling.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings"
    )


def _threshold(model_type: str, rope_type: str, config: dict) -> int | None:
    mpe = config.get("max_position_embeddings", 2048)
    if rope_type == "dynamic":
        return int(mpe)
    if rope_type == "longrope" and model_type in LONGROPE_PER_CALL:
        return int(config.get("original_max_position_embeddings") or mpe)
    return None


def checkpoint_rope(path: object) -> tuple[str, RopeSetting | None]:
    """``(config.json path, setting)`` of a local checkpoint; ``("", None)`` when unknown
    (a hub id not downloaded, no ``config.json``, a family not served)."""
    from .checkpoint_config import read_checkpoint_config

    config = read_checkpoint_config(path)
    if config is None or config.data is None:
        return "", None  # unreadable: config.checkpoint_findings refuses that
    return config.source, rope_setting(config.data)
