"""Start-up: load xtuner-rope before XTuner builds anything, then check and prepare the config.

``xtuner train`` runs ``cfg.model_resource.fn`` (``set_model_resource``) before the model and
the dataset: :func:`enable_xtuner_rope` in that slot refuses every conflicting setting with the
exact edit, fixing (and logging) what has one right answer.

The findings engine: :func:`register_findings`, :func:`inspect_config` (pure) and
:func:`prepare_config`. Each topic registers its own (``xtuner_rope.FINDINGS_MODULES``):
``config.patch_needs``, ``config.packing``, ``config.moss``, ``config.frameworks``,
``config.multimodal``, ``config.internvl``, ``config.llava_tower``, ``config.launch``,
``config.optimizer_state``, ``config.sequence_parallel``, ``config.rope_scaling``,
``config.runtime``, ``config.heldout.findings``, ``config.heldout.shortcut``, ``config.families``,
``config.checkpoint_findings``, ``config.preference``, ``config.loss``, ``config.accumulation``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mmengine.config import Config
from mmengine.logging import print_log

from xtuner_rope.compat import run_patch
from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.compat.xtuner_model_resource import config_being_started, keep_other_model_paths

from .findings import MODEL_RESOURCE_EDIT, ConfigConflict, Finding, conflict_message, slot_rank

# "fixes": what the start-up applied, so the re-check of the config that really trains can
# name a fix that an override (``--cfg-options``, merged after the start-up) undid.
_STATE = {"prepared": False, "fixes": []}
_active = False  # set by `xtuner_rope.activate` (mark_active): the start-up refuses without it
FindingsFn = Callable[[Config], list]  # a config -> its findings (`Finding` list)


def inspect_config(cfg: Config) -> list[Finding]:
    """Every change the plugin needs in ``cfg`` (as ``Config.fromfile`` returns it) and every
    conflict it cannot resolve, in config order; pure (nothing changed until a ``fix`` runs).
    """
    return [
        finding
        for _, check in sorted(FINDINGS, key=lambda entry: slot_rank(entry[0]))
        for finding in check(cfg)
    ]


def register_findings(order: str) -> Callable[[FindingsFn], FindingsFn]:
    """Decorator: add a findings function to what :func:`inspect_config` runs, at slot ``order`` of
    :data:`SLOTS` (where its findings appear, when their fixes apply); ValueError for no slot.
    """
    slot_rank(order)  # refuse an unknown slot when the module registers, not at start-up

    def register(check: FindingsFn) -> FindingsFn:
        if all(registered is not check for _, registered in FINDINGS):
            FINDINGS.append((order, check))
        return check

    return register


# (slot, findings function), in registration order: every findings module registers its own.
FINDINGS: list[tuple[str, FindingsFn]] = []


def prepare_config(cfg: Config) -> list[Finding]:
    """Apply the plugin's fixes to ``cfg`` (in place, each logged and returned) and refuse what
    cannot be fixed.

    Raises:
        ConfigConflict: every conflicting setting with its exact edit, all at once.
    """
    findings = inspect_config(cfg)
    conflicts = [f for f in findings if f.fix is None]
    if conflicts:
        raise ConfigConflict(conflict_message(conflicts))
    fixes = [f for f in findings if f.fix is not None]
    for fix in fixes:
        fix.fix()
        print_log(f"xtuner-rope: {fix.setting}: {fix.problem}; {fix.edit}.", logger="current")
    _STATE["prepared"] = True
    _STATE["fixes"] = fixes
    return fixes


def applied_fixes() -> list[Finding]:
    """The fixes the start-up applied in this process (empty before it ran)."""
    return list(_STATE["fixes"])


def is_prepared() -> bool:
    """True once :func:`prepare_config` ran in this process (through ``model_resource``)."""
    return _STATE["prepared"]


@contextmanager
def state_kept() -> Iterator[None]:
    """Run the block and put the start-up's state (prepared, fixes) back as it was (for the doctor,
    which starts a config only to look at it).
    """
    kept = dict(_STATE)
    try:
        yield
    finally:
        _STATE.update(kept)


def prepare_started_config(path: str) -> str:
    """Prepare the config ``set_model_resource`` starts (``config_being_started``); return ``path``.

    Raises:
        ConfigConflict: see :func:`prepare_config`; or the plugin is not active (the config named
            the function by a module path instead of ``from xtuner_rope import ...``).
    """
    cfg = config_being_started()
    if cfg is not None:
        _refuse_inactive(cfg)
        prepare_config(cfg)
        # a LLaVA config's CLIP paths are not the LLM's
        run_patch(keep_other_model_paths, cfg, path)
    return path


def mark_active() -> None:
    """Record that the plugin is active in this process (``xtuner_rope.activate`` calls it)."""
    global _active
    _active = True


def _refuse_inactive(cfg: Config) -> None:
    """Refuse (``ConfigConflict``) to start ``cfg`` where the plugin was never activated, naming the
    import to write.
    """
    if _active:
        return
    resource = dict.get(config_dict(cfg), "model_resource") or {}
    fn = resource.get("fn") if isinstance(resource, dict) else None
    name = getattr(fn, "__name__", None) or "enable_xtuner_rope"
    raise ConfigConflict(
        f"model_resource.fn={name}: xtuner-rope is not active in this process (its patches "
        "and hooks are missing): the config imports the function from a module of the "
        "package, and importing a module activates nothing. Import it from the package, "
        f"which activates the plugin when the name is read:\n    from xtuner_rope import {name}"
    )


def enable_xtuner_rope(path: str, local_only: bool = False) -> str:
    """``model_resource`` function: load xtuner-rope, check and prepare the config; returns ``path``
    (the config's ``pretrained_model_name_or_path``) unchanged.

    Use as ``model_resource = dict(fn=enable_xtuner_rope)`` in PART 1 of an XTuner config;
    ``local_only=True`` refuses a path that is not a local checkpoint (no download in training).

    Raises:
        ConfigConflict: see :func:`prepare_config`.
        FileNotFoundError: ``local_only`` and ``path`` has no ``config.json``.
    """
    if local_only and not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model_resource: pretrained_model_name_or_path={path!r} is not a local checkpoint "
            "directory (no config.json there). Download it first, e.g. `huggingface-cli download "
            "internlm/internlm2-chat-7b --local-dir <dir>`, and set "
            "pretrained_model_name_or_path in PART 1 of the config to <dir>."
        )
    return prepare_started_config(path)


def require_prepared(cfg: object, who: str) -> None:
    """Refuse a run whose ``runner.cfg`` was not prepared at start-up (the plugin loaded too late);
    ``who``: the caller, for the message.

    Raises:
        ConfigConflict: ``cfg`` is a Config and :func:`prepare_config` never ran here.
    """
    if not isinstance(cfg, Config) or cfg.filename is None or is_prepared():
        return
    raise ConfigConflict(
        f"{who}: xtuner-rope was loaded after XTuner built the model, too late for its "
        "start-up: its patches (LoRA/QLoRA's bitsandbytes import, CPU training) and its "
        "config checks (packing without boundaries, use_varlen_attn, AMP on CPU) did not run. "
        f"To fix, {MODEL_RESOURCE_EDIT}\n(or call xtuner_rope.config.startup.prepare_config(cfg) "
        "before building the Runner yourself)."
    )


__all__ = [
    "FINDINGS",
    "applied_fixes",
    "enable_xtuner_rope",
    "inspect_config",
    "is_prepared",
    "mark_active",
    "prepare_config",
    "prepare_started_config",
    "register_findings",
    "require_prepared",
    "state_kept",
]
