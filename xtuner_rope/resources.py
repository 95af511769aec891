"""Deprecated: the ``model_resource`` functions that earlier READMEs and recipes named.

Earlier versions turned the plugin on with::

    from xtuner_rope.resources import local_checkpoint
    model_resource = dict(fn=local_checkpoint)

Configs written that way keep training: each name here does what its replacement does and,
each time it is called, warns with the edit to make, on two channels: a ``FutureWarning``
(for code and tests) and a WARNING line on MMEngine's logger, because ``xtuner train`` never
shows the former: importing ``xtuner.dataset`` (xtuner 0.2.0) sets a global ``ignore`` filter
for ``FutureWarning`` (and Python hides ``DeprecationWarning`` outside ``__main__``).
``xtuner train`` calls ``model_resource`` before the run's log file exists, so the line reaches
the console.
"""

from __future__ import annotations

import logging
import warnings

from mmengine.logging import print_log

from .config.startup import enable_xtuner_rope

# old name -> the edit that replaces it.
REPLACEMENTS = {
    "local_checkpoint": (
        "from xtuner_rope import enable_xtuner_rope\n"
        "    model_resource = dict(fn=enable_xtuner_rope, "
        "args=dict(local_only=True))"
    ),
    "tiny_internlm2": (
        "from xtuner_rope.demo.resources import tiny_checkpoint\n"
        "    model_resource = dict(fn=tiny_checkpoint, args=dict(...))"
    ),
}


def _warn_deprecated(name: str) -> None:
    message = (
        f"xtuner_rope.resources.{name} is deprecated and will be removed; it still "
        f"works. Replace the config's import and model_resource with:\n"
        f"    {REPLACEMENTS[name]}"
    )
    warnings.warn(message, FutureWarning, stacklevel=3)
    print_log(message, logger="current", level=logging.WARNING)


def local_checkpoint(path: str) -> str:
    """Deprecated alias of ``enable_xtuner_rope(path, local_only=True)``.

    Args:
        path: The config's ``pretrained_model_name_or_path``: a local checkpoint directory.

    Returns:
        ``path``.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ConfigConflict: see :func:`xtuner_rope.config.startup.prepare_config`.
    """
    _warn_deprecated("local_checkpoint")
    return enable_xtuner_rope(path, local_only=True)


def tiny_internlm2(
    path: str,
    data_path: str = "data/short_dialogues.jsonl",
    seed: int = 0,
    family: str = "internlm2",
) -> str:
    """Deprecated alias of :func:`xtuner_rope.demo.resources.tiny_checkpoint` (same arguments)."""
    from .demo.resources import tiny_checkpoint

    _warn_deprecated("tiny_internlm2")
    return tiny_checkpoint(path, data_path=data_path, seed=seed, family=family)


__all__ = ["enable_xtuner_rope", "local_checkpoint", "tiny_internlm2"]
