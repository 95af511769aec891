"""MMEngine's private config dict, read through one accessor: :func:`config_dict`.

mmengine 0.10.6 keeps the parsed config in ``Config._cfg_dict`` (whose lazy objects
``dict.get`` reads without building them, unlike ``Config.__getattr__``). Every reader or editor
of a config goes through :func:`config_dict`: a renamed attribute is one clear error here.
"""

from __future__ import annotations

__all__ = ["ConfigDictUnavailable", "config_dict", "is_config"]

_PRIVATE = "_cfg_dict"  # mmengine 0.10.x: Config.__init__ sets it with object.__setattr__


class ConfigDictUnavailable(TypeError):
    """This MMEngine's ``Config`` keeps its dict under another name than 0.10's ``_cfg_dict``."""


def config_dict(cfg: object) -> dict:
    """The dict behind ``cfg`` (the same object: edits change the config), lazy objects unbuilt;
    a plain ``dict`` / ``ConfigDict`` is returned as is.

    Raises:
        ConfigDictUnavailable: ``cfg`` has no ``_cfg_dict`` (an MMEngine other than 0.10.x).
    """
    if isinstance(cfg, dict):
        return cfg
    try:
        return object.__getattribute__(cfg, _PRIVATE)
    except AttributeError:
        from .guard import installed_version

        raise ConfigDictUnavailable(
            f"xtuner_rope.compat.config_dict: {type(cfg).__name__} has no {_PRIVATE} (mmengine "
            f"{installed_version('mmengine')}); xtuner-rope reads MMEngine 0.10's Config "
            "without building its lazy objects: install pip install 'mmengine~=0.10.6'."
        ) from None


def is_config(cfg: object) -> bool:
    """True if ``cfg`` is a ``Config`` whose dict :func:`config_dict` can read."""
    try:
        object.__getattribute__(cfg, _PRIVATE)
    except AttributeError:
        return False
    return True
