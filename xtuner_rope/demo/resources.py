"""The tiny recipes' ``model_resource``: build the tiny checkpoint, then start the plugin.

``xtuner train`` calls ``cfg.model_resource.fn(cfg.pretrained_model_name_or_path, **args)``
first thing (``xtuner.tools.utils.set_model_resource``) and replaces every
``pretrained_model_name_or_path`` in the config with the returned path. :func:`tiny_checkpoint`
builds the tiny checkpoint there when it is missing, then does what
:func:`xtuner_rope.config.startup.enable_xtuner_rope` does (check and prepare the config).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..config.startup import prepare_started_config

__all__ = ["tiny_checkpoint", "tiny_llava"]


def tiny_checkpoint(
    path: str, data_path: str | None = None, seed: int = 0, family: str = "internlm2"
) -> str:
    """Return the embedded tiny checkpoint at ``path``, building it if it is missing.

    Safe under several processes: each builds into its own temporary directory and renames it
    into place; the first rename wins and the others discard their identical copy.

    Args:
        path: Checkpoint directory.
        data_path: Dialogues that train the tokenizer; None: the sample dialogues the package
            ships (``short_dialogues.jsonl``, linked from ``data/``), wherever the current
            directory is.
        seed: Weight-initialisation seed.
        family: ``'internlm2'`` (default), or ``'qwen2'`` / ``'llama'`` / ``'mistral'`` for
            the tiny transformers stand-ins of the other recipes.

    Returns:
        ``path``.
    """
    from .tiny import save_tiny_internlm2

    if (Path(path) / "config.json").is_file():
        return prepare_started_config(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_tiny_internlm2(tmp, data_path, seed=seed, family=family)
    try:
        os.rename(tmp, path)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
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
    """The tiny LLaVA recipe's ``model_resource``: tiny LLM, tiny CLIP and data, then start.

    Builds what is missing (the tiny InternLM2 at ``path``, the tiny CLIP vision tower and
    image processor at ``clip_path``, drawn images plus short dialogues in LLaVA format under
    ``data_dir``), then prepares the config as :func:`xtuner_rope.config.startup.enable_xtuner_rope`.

    Returns:
        ``path``.
    """
    from .llava_data import write_llava_data
    from .tiny_clip import save_tiny_clip

    _build_once(clip_path, "config.json", lambda tmp: save_tiny_clip(tmp, seed=seed))
    _build_once(data_dir, "llava_data.json", lambda tmp: write_llava_data(tmp, seed=seed))
    return tiny_checkpoint(path, seed=seed)
