"""The tiny recipes' ``model_resource``: build the tiny checkpoint where missing, then start the
plugin."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..config.startup import prepare_started_config

__all__ = ["tiny_checkpoint", "tiny_llava"]


def tiny_checkpoint(
    path: str, data_path: str | None = None, seed: int = 0, family: str = "internlm2"
) -> str:
    """Return ``path``, building the tiny checkpoint there (process-safe) if it is missing.

    Args:
        data_path: Dialogues that train the tokenizer; None: the shipped sample dialogues.
        family: ``'internlm2'`` (default), or another of ``demo.tiny.FAMILIES``.
    """
    from .tiny import save_tiny

    _build_once(path, "config.json", lambda tmp: save_tiny(tmp, family, data_path, seed=seed))
    return prepare_started_config(path)


def _build_once(path: str, marker: str, build) -> None:
    """``build(tmp)`` then rename to ``path``, unless ``path/marker`` exists (process-safe)."""
    if (Path(path) / marker).is_file():
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    build(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)


def tiny_llava(
    path: str, clip_path: str = "models/tiny-clip", data_dir: str = "data/tiny_llava", seed: int = 0
) -> str:
    """The tiny LLaVA recipe's ``model_resource``: tiny LLM, tiny CLIP and data, then start;
    returns ``path``."""
    from .llava_data import write_llava_data
    from .tiny_clip import save_tiny_clip

    _build_once(clip_path, "config.json", lambda tmp: save_tiny_clip(tmp, seed=seed))
    _build_once(data_dir, "llava_data.json", lambda tmp: write_llava_data(tmp, seed=seed))
    return tiny_checkpoint(path, seed=seed)
