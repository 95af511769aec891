"""A checkpoint's ``config.json``, read without loading anything: the package's one reader.

The start-up reads the LLM's ``config.json`` before a weight loads: its family
(``models.families.checkpoint_verdict``), ``attn_implementation`` (``config.families``), its
attention heads (``config.sequence_parallel``) and ``vocab_size`` (``config.preference``). All
of them read it through :func:`checkpoint_config`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["checkpoint_config", "config_json_path"]


def config_json_path(path: object, cached: bool = False) -> Path | None:
    """Where the ``config.json`` of ``path`` is, or None.

    Args:
        path: ``pretrained_model_name_or_path``: a local directory or a hub id.
        cached: Also a hub id's ``config.json`` that a previous download left in the local
            Hugging Face cache (offline: nothing is downloaded).
    """
    if not isinstance(path, str) or not path:
        return None
    local = Path(path) / "config.json"
    if local.is_file():
        return local
    if not cached or Path(path).exists() or path.count("/") != 1:
        return None  # a local path without config.json, or no hub id
    try:  # offline: only what a previous download left in the cache
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "config.json")
    except Exception:  # noqa: BLE001 - an unknowable id is not an error here
        return None
    return Path(found) if isinstance(found, str) else None


def checkpoint_config(path: object, cached: bool = False) -> tuple[Path, dict] | None:
    """The ``config.json`` of ``path`` and what it holds; None where there is none.

    Args: as :func:`config_json_path`.

    Raises:
        ValueError: the file is not a JSON object (a truncated download, an edit gone wrong);
            the message names the file.
    """
    config = config_json_path(path, cached)
    if config is None:
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{config}: not readable as JSON ({error}); the checkpoint's config.json must be "
            "the JSON object `save_pretrained` writes: re-download or fix it"
        ) from error
    if not isinstance(data, dict):
        raise ValueError(
            f"{config}: holds a JSON {type(data).__name__}, not the object `save_pretrained` "
            "writes: re-download or fix it"
        )
    return config, data
