"""The config that really trains, checked again before the first step.

``--cfg-options``, merged after the start-up, can undo a fix or bring a conflict in:
:func:`recheck_started_config` (``ValidatedRoPEHook``, on ``runner.cfg``) refuses such a run
with the start-up's message; the doctor calls :func:`recheck_config`.
"""

from __future__ import annotations

import sys

from mmengine.config import Config

from .findings import ConfigConflict, Finding, conflict_message
from .startup import applied_fixes, inspect_config, is_prepared


def cfg_options_argument(argv: list[str] | None = None) -> list[str]:
    """The ``key=value`` tokens after ``--cfg-options`` in ``argv`` (default ``sys.argv``), or []"""
    argv = sys.argv if argv is None else argv
    given, taking = [], False
    for arg in argv[1:]:
        if arg.startswith("--"):
            taking = arg == "--cfg-options"
            continue
        if taking:
            given.append(arg)
    return given


def _named(overrides: object) -> str:
    """`` (--cfg-options given: a=1 b=2)``: what the user really changed (the finding's setting
    may be another one the override affects: sequence_parallel_size -> the collate function)."""
    if isinstance(overrides, dict):
        overrides = [f"{k}={v}" for k, v in overrides.items()]
    return f" (--cfg-options given: {' '.join(overrides)})" if overrides else ""


def recheck_config(
    cfg: Config, fixes: list[Finding] | None = None, overrides: object = None
) -> list[Finding]:
    """What the start-up would say about ``cfg`` (``runner.cfg``, every override merged) now, as
    conflicts only: ``fixes`` the start-up applied (default: in this process; a finding on a fixed
    setting says its fix was overridden), ``overrides`` the ``--cfg-options`` given (a dict or
    ``key=value`` strings, named in each). Empty when the start-up's verdict still holds.
    """
    fixed = {f.setting: f for f in (applied_fixes() if fixes is None else fixes)}
    conflicts = []
    for f in inspect_config(cfg):
        if f.setting in fixed:
            problem = (
                f"the start-up's fix ({fixed[f.setting].edit}) was overridden after it "
                f"ran (--cfg-options are merged after model_resource): {f.problem}"
            )
        else:
            problem = f"set after the start-up ran (--cfg-options): {f.problem}"
        edit = (
            f.edit
            if f.fix is None
            else (
                f"{f.edit}; make it so in the config file or in the --cfg-options: merged after the "
                "start-up, an override cannot be fixed by it"
            )
        )
        conflicts.append(Finding(f.setting, problem + _named(overrides), edit))
    return conflicts


def recheck_started_config(cfg: object, who: str) -> None:
    """Refuse to train when ``runner.cfg`` conflicts (a run the start-up prepared); ``who``: the
    caller, for the message.

    Raises:
        ConfigConflict: the same message and edits as at start-up, each naming the override.
    """
    if not isinstance(cfg, Config) or cfg.filename is None or not is_prepared():
        return
    conflicts = recheck_config(cfg, overrides=cfg_options_argument())
    if conflicts:
        raise ConfigConflict(
            f"{who}: checked again before the first step, on the config that "
            f"really trains: {conflict_message(conflicts)}"
        )


__all__ = ["cfg_options_argument", "recheck_config", "recheck_started_config"]
