"""Start a config as ``xtuner train`` does: the one place the doctor, the check and the zoo do it.

``xtuner/tools/train.py`` (XTuner 0.2.0) runs ``Config.fromfile``, the config's
``model_resource`` (the plugin's start-up), ``merge_from_dict(--cfg-options)``, then builds the
Runner: a tool that predicts a run sees the config in that state.
"""

from __future__ import annotations

import contextlib

from mmengine.config import Config

from .findings import ConfigConflict
from .startup import state_kept


def start(cfg: Config, cfg_options: dict | None = None, look_only: bool = False) -> Config:
    """Run ``cfg``'s ``model_resource`` and merge ``cfg_options`` (a dict, or None), in ``xtuner
    train``'s order; ``cfg`` (as ``Config.fromfile`` returns it) is changed in place and returned.

    ``look_only`` (the doctor): a conflict is not raised (``inspect_config`` reports it) and the
    process stays not prepared.

    Raises:
        ConfigConflict: the start-up refuses a setting (not with ``look_only``).
    """
    from xtuner.tools.utils import set_model_resource

    if cfg.get("model_resource"):
        if look_only:
            with state_kept(), contextlib.suppress(ConfigConflict):
                set_model_resource(cfg)
        else:
            set_model_resource(cfg)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def start_file(path: str, cfg_options: dict | None = None, look_only: bool = False) -> Config:
    """:func:`start` on ``Config.fromfile(path)``: the config as ``xtuner train`` builds it."""
    return start(Config.fromfile(path), cfg_options, look_only)
