"""XTuner ``set_model_resource`` patches: a LLaVA config's LLM path, other models' paths kept.

xtuner 0.2.0 ``set_model_resource(cfg)`` calls ``cfg.model_resource.fn(path, **args)``: the
config being started is not handed to ``fn``. :func:`config_being_started` is how the start-up
gets it: the config handed over explicitly by this module's ``set_model_resource`` wrapper
(:func:`patch_set_model_resource_llm_path`: every in-process caller once the plugin is active),
else, for ``xtuner train`` itself, whose ``tools/train.py`` bound XTuner's own function before
the config (and with it the plugin) was read, the ``cfg`` of that call's frame. That function is
the package's only reader of the interpreter's frames (``tests/test_layout.py`` holds it so).
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

    Inside that call (``xtuner train``'s, or the doctor's start-up) XTuner writes the path
    ``fn`` returns into every nested ``pretrained_model_name_or_path`` right after: the
    top-level setting is the checkpoint that will load. None outside it.

    The config comes from the wrapper of :func:`patch_set_model_resource_llm_path`, which hands
    it over explicitly. ``xtuner train`` calls XTuner's unwrapped function (its ``train.py``
    imported the name before the config, and so the plugin, was read: no patch can reach that
    call), so there the config is the ``cfg`` argument of the ``set_model_resource`` frame up
    the stack: the one frame read of the package.
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

    xtuner 0.2.0 ``set_model_resource`` calls ``fn(cfg["pretrained_model_name_or_path"])``;
    XTuner's LLaVA/InternVL configs name the LLM ``llm_name_or_path`` and have no such key:
    ``xtuner train`` stops with ``KeyError: 'pretrained_model_name_or_path'``. The config's
    ``from xtuner_rope import enable_xtuner_rope`` is read (lazily) by that very call, just
    before the key is read, and reading it activates the plugin, so here the config being started gets the key, set to its
    ``llm_name_or_path`` (logged). Applies only inside that call (``xtuner train``).
    """
    return _give_llm_path(config_being_started())


def _llm_path_setting(cfg) -> str | None:
    """The top-level setting naming the LLM of a config without ``pretrained_model_name_or_path``.

    LLaVA configs name it ``llm_name_or_path``; XTuner's InternVL configs name the whole model
    ``path`` (their ``model.model_path``): the start-up then refuses InternVL with its reason
    instead of XTuner's ``KeyError``.
    """
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
    """The same gap for later callers of xtuner 0.2.0 ``set_model_resource`` in this process.

    Where the plugin is already active when the config is started (``xtuner-rope
    doctor`` / ``check`` / ``replay`` call ``xtuner.tools.utils.set_model_resource`` in
    process), :func:`patch_model_resource_llm_path` cannot act: the module's function gets the
    LLM path first instead (same ``KeyError`` otherwise).
    """
    import xtuner.tools.utils as xtuner_utils

    original = xtuner_utils.set_model_resource
    if getattr(original, "__wrapped__", None) is not None:
        return False

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

    After ``model_resource.fn`` returns, XTuner writes its result into *every* nested
    ``pretrained_model_name_or_path`` of the config: in a LLaVA config the CLIP encoder's and
    the image processor's become the LLM's path (``OSError: ... does not appear to have a file
    named preprocessor_config.json``). Another model's path is one a top-level
    ``*_name_or_path`` setting other than the LLM's names (``visual_encoder_name_or_path``).
    Where such paths exist, XTuner's write-back is done here for every other nested path (with
    the config's own path, which xtuner-rope's ``model_resource`` functions return unchanged),
    and XTuner's walk is skipped, once, by handing it an empty ``items()`` of the config. Call
    from inside ``fn``; configs without another model's path are left to XTuner, and so is
    the write-back when ``fn`` returns another path than the config's (``returned``).

    Returns:
        True if the write-back was done here and XTuner's will be skipped.
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
