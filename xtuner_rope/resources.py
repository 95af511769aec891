"""``model_resource`` functions for XTuner configs: resolve the model path before training.

Each one also prepares the config like :func:`xtuner_rope.startup.enable_xtuner_rope`
(re-exported here), which leaves the path as it is.

``xtuner train`` calls ``cfg.model_resource.fn(cfg.pretrained_model_name_or_path, **args)``
first thing (``xtuner.tools.train.set_model_resource``), before it checks the config, starts
the distributed backend or builds the model, and replaces every ``pretrained_model_name_or_path``
in the config with the returned path. Naming one of these functions there therefore also loads
``xtuner_rope`` early enough for its ``compat`` patches to matter: MMEngine's lazy config import
would otherwise load the plugin only when the hooks are built, after the model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .startup import enable_xtuner_rope, prepare_started_config

__all__ = ["enable_xtuner_rope", "local_checkpoint", "tiny_internlm2"]


def tiny_internlm2(path: str, data_path: str = "data/short_dialogues.jsonl", seed: int = 0,
                   family: str = "internlm2") -> str:
    """Return the embedded tiny checkpoint at ``path``, building it if it is missing.

    Safe under several processes: each builds into its own temporary directory and renames it
    into place; the first rename wins and the others discard their identical copy.

    Args:
        path: Checkpoint directory.
        data_path: Dialogues that train the tokenizer.
        seed: Weight-initialisation seed.
        family: ``'internlm2'`` (default), or ``'qwen2'`` / ``'llama'`` for the tiny
            transformers stand-ins of the other recipes.

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


def local_checkpoint(path: str) -> str:
    """Check that ``path`` is a local Hugging Face checkpoint directory and return it.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``; the message says how to fix it.
    """
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model_resource: pretrained_model_name_or_path={path!r} is not a local checkpoint "
            "directory (no config.json there). Download it first, e.g. `huggingface-cli download "
            "internlm/internlm2-chat-7b --local-dir <dir>`, and set "
            "pretrained_model_name_or_path in PART 1 of the config to <dir>.")
    return prepare_started_config(path)
