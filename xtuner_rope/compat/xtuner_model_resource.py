"""XTuner ``set_model_resource`` patches: a LLaVA config's LLM path, other models' paths kept.

:func:`config_being_started` gives the start-up the config that xtuner 0.2.0's
``set_model_resource`` does not pass: handed over by :func:`patch_set_model_resource_llm_path`,
else (``xtuner train`` bound XTuner's function first) the ``cfg`` of that call's frame: the
package's only reader of the interpreter's frames (``tests/test_layout.py``).
"""

from __future__ import annotations

import functools
import os
import sys

from .mmengine_config import config_dict, is_config

# The configs handed over by the ``set_model_resource`` wrapper, innermost last.
_HANDED_OVER: list = []
_XTUNER_UTILS = os.path.join("xtuner", "tools", "utils.py")


def config_being_started():
    """The config whose ``model_resource`` xtuner 0.2.0 ``set_model_resource`` is running now.

    The one the wrapper handed over, else the ``cfg`` argument of the ``set_model_resource`` frame
    up the stack (``xtuner train`` calls XTuner's unwrapped function). None outside that call.
    """
    if _HANDED_OVER:
        return _HANDED_OVER[-1]
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "set_model_resource" and code.co_filename.endswith(_XTUNER_UTILS):
            cfg = frame.f_locals.get("cfg")
            return cfg if is_config(cfg) else None
        frame = frame.f_back
    return None


def patch_model_resource_llm_path() -> bool:
    """Give a LLaVA config the ``pretrained_model_name_or_path`` XTuner's start-up reads.

    xtuner 0.2.0 ``set_model_resource`` reads ``cfg["pretrained_model_name_or_path"]``; LLaVA and
    InternVL configs name the LLM otherwise (``KeyError``). Reading the config's
    ``enable_xtuner_rope`` activates the plugin just before, so the config being started gets the
    key (logged). Applies only inside that call (``xtuner train``).
    """
    return _give_llm_path(config_being_started())


def _llm_path_setting(cfg) -> str | None:
    """The top-level setting naming the LLM (``llm_name_or_path``; InternVL's ``path``), or None."""
    if isinstance(dict.get(config_dict(cfg), "llm_name_or_path"), str):
        return "llm_name_or_path"
    model = dict.get(config_dict(cfg), "model")
    path = dict.get(config_dict(cfg), "path")
    if isinstance(path, str) and isinstance(model, dict) and model.get("model_path") == path:
        return "path"
    return None


def _give_llm_path(cfg) -> bool:
    """``cfg.pretrained_model_name_or_path = cfg.llm_name_or_path`` (or InternVL's ``path``)."""
    if cfg is None or "pretrained_model_name_or_path" in config_dict(cfg):
        return False
    setting = _llm_path_setting(cfg)
    if setting is None:
        return False
    llm_path = dict.get(config_dict(cfg), setting)
    config_dict(cfg)["pretrained_model_name_or_path"] = llm_path
    from mmengine.logging import print_log

    print_log(
        "xtuner-rope: pretrained_model_name_or_path: missing (a LLaVA/InternVL config names "
        f"its LLM {setting}); set to {setting} = {llm_path!r} for XTuner's "
        "set_model_resource.",
        logger="current",
    )
    return True


def patch_set_model_resource_llm_path() -> bool:
    """The same gap for the in-process callers of xtuner 0.2.0 ``set_model_resource``.

    ``xtuner-rope doctor`` / ``check`` / ``replay`` start the config with the plugin active: the
    wrapper gives the LLM path first, and hands the config to :func:`config_being_started`.
    """
    import xtuner.tools.utils as xtuner_utils

    original = xtuner_utils.set_model_resource

    @functools.wraps(original)
    def with_llm_path(cfg):
        if cfg.get("model_resource"):
            _give_llm_path(cfg)
        _HANDED_OVER.append(cfg)  # what config_being_started answers during the call
        try:
            return original(cfg)
        finally:
            _HANDED_OVER.pop()

    xtuner_utils.set_model_resource = with_llm_path
    return True


def keep_other_model_paths(cfg, returned: str) -> bool:
    """Stop xtuner 0.2.0 ``set_model_resource`` overwriting the paths of other models.

    XTuner writes ``fn``'s result into every nested ``pretrained_model_name_or_path`` (a LLaVA
    config's CLIP and image processor too: ``OSError``). Where a top-level ``*_name_or_path`` names
    another model, the write-back is done here and XTuner's walk skipped once (an empty
    ``items()``). Call from inside ``fn``; True if done, False when ``fn`` returns another path.
    """
    top = config_dict(cfg)
    path = dict.get(top, "pretrained_model_name_or_path")
    others = {
        v
        for k, v in dict.items(top)
        if isinstance(v, str)
        and v != path
        and k.endswith("_name_or_path")
        and k not in ("pretrained_model_name_or_path", "llm_name_or_path")
    }
    nested = list(_nested_paths(top))
    if (
        returned != path
        or not any(value in others for _, _, value in nested)
        or config_being_started() is not cfg
    ):
        return False
    for node, key, value in nested:
        if value not in others:
            node[key] = path
    base = type(top)

    class _SkipWriteBack(base):
        def items(self):
            object.__setattr__(self, "__class__", base)
            return []

    object.__setattr__(top, "__class__", _SkipWriteBack)
    return True


def _nested_paths(node, depth: int = 0):
    """``(dict, key, value)`` of every ``pretrained_model_name_or_path`` below the top level."""
    items = (
        dict.items(node)
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, value in items:
        if depth and key == "pretrained_model_name_or_path":
            yield node, key, value
        if isinstance(value, (dict, list)):
            yield from _nested_paths(value, depth + 1)
