"""Old module paths that still import: each is the new module under its old name, with a warning.

Issue 27 sorted the package's face into role folders (``config/``, ``data/``, ``hooks/``,
``compat/``). Configs, scripts and notebooks written before it name the old modules
(``from xtuner_rope.collate import rope_collate_fn``, ``xtuner_rope.startup``...): a finder on
``sys.meta_path`` answers those names with the new module itself (the same object, so state such
as ``startup`` 's and ``monkeypatch.setattr`` on it stay shared) and a ``DeprecationWarning``
that names the replacement. Add a row to ``MOVED`` when a module moves; never leave a file at the
old path.

Issue 35 sorted the top floor by job: ``xtuner-rope check`` went to ``check/``, the captures of
real runs and the measurements they share with it to ``capture/``, replay and XTuner's tools
to ``outputs/``; ``doctor/`` kept the dataset doctor. The old paths work until :data:`REMOVED_IN` and warn until then.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# The release that drops the old paths below (the package is 0.1.x today): a documented name is
# API, so an old path keeps working, with the warning, for every 0.x release before it.
REMOVED_IN = "1.0.0"

# Old module -> the module it is now.
MOVED = {
    "xtuner_rope.startup": "xtuner_rope.config.startup",
    "xtuner_rope.startup_multimodal": "xtuner_rope.config.multimodal",
    "xtuner_rope.startup_sequence_parallel": "xtuner_rope.config.sequence_parallel",
    "xtuner_rope.launch_findings": "xtuner_rope.config.launch",
    "xtuner_rope.preference": "xtuner_rope.config.preference",
    "xtuner_rope.overrides": "xtuner_rope.config.overrides",
    "xtuner_rope.collate": "xtuner_rope.data.collate",
    "xtuner_rope.collate_llava": "xtuner_rope.data.collate_llava",
    "xtuner_rope.packed_dataset": "xtuner_rope.data.packed_dataset",
    "xtuner_rope.monitor": "xtuner_rope.hooks.monitor",
    "xtuner_rope.loss_norm": "xtuner_rope.hooks.loss_norm",
    "xtuner_rope.checkpoint": "xtuner_rope.compat.checkpoint",
    # Before the ops/batch split, check_packed_batch lived in a top-level `validate` module.
    "xtuner_rope.validate": "xtuner_rope.batch.checks",
    # Issue 35: the top floor sorted by job (check/, capture/; doctor/ keeps the dataset doctor).
    # The old check and check_report modules are the check package: it holds all their names.
    "xtuner_rope.doctor.check": "xtuner_rope.check",
    "xtuner_rope.doctor.check_report": "xtuner_rope.check",
    "xtuner_rope.doctor.check_preference": "xtuner_rope.check.preference",
    "xtuner_rope.doctor.llava_check": "xtuner_rope.check.llava",
    "xtuner_rope.doctor.check_measure": "xtuner_rope.capture.measure",
    "xtuner_rope.doctor.check_randomness": "xtuner_rope.capture.randomness",
    "xtuner_rope.doctor.check_capture": "xtuner_rope.capture.text",
    "xtuner_rope.doctor.llava_capture": "xtuner_rope.capture.llava",
    "xtuner_rope.doctor.preference_capture": "xtuner_rope.capture.preference",
    "xtuner_rope.doctor.replay": "xtuner_rope.outputs.replay",
    "xtuner_rope.doctor.xtuner_tools": "xtuner_rope.outputs.xtuner_tools",
    # Issue 47: the held-out start-up grouped in one package, a module per concern.
    "xtuner_rope.config.heldout_files": "xtuner_rope.config.heldout.files",
    "xtuner_rope.config.heldout_pairs": "xtuner_rope.config.heldout.models",
    "xtuner_rope.config.heldout_shortcut": "xtuner_rope.config.heldout.shortcut",
}


# Old names inside modules that stay -> (the module that holds the name now, its name there).
# The module gets a ``__getattr__`` (PEP 562) when it is imported: the old name warns and
# answers with the new object.
MOVED_NAMES = {
    # Before whole-dialogue packing, XTuner's cut plan was packed_dataset.pack_plan.
    ("xtuner_rope.data.packed_dataset", "pack_plan"): ("xtuner_rope.data.pack_plans", "cut_plan"),
    # Issue 47: the start-up finding left the hook's module for config/.
    ("xtuner_rope.hooks.optimizer_state", "save_optimizer_findings"): (
        "xtuner_rope.config.optimizer_state",
        "save_optimizer_findings",
    ),
}


def name_message(module: str, name: str) -> str:
    """The warning for reading ``module.name`` of :data:`MOVED_NAMES`: the import to write."""
    new_module, new_name = MOVED_NAMES[(module, name)]
    return (
        f"{module}.{name} is deprecated: it is {new_module}.{new_name}. Write "
        f"`from {new_module} import {new_name}` instead; the old name keeps working, with this "
        f"warning, until xtuner-rope {REMOVED_IN}."
    )


def _moved_names_getattr(module: str):
    """The ``__getattr__`` of ``module``: its old names of :data:`MOVED_NAMES`, with a warning."""

    def __getattr__(name: str) -> object:
        if (module, name) not in MOVED_NAMES:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(name_message(module, name), DeprecationWarning, stacklevel=2)
        new_module, new_name = MOVED_NAMES[(module, name)]
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__


class _MovedNamesLoader(importlib.abc.Loader):
    """The module's own loader, then its old names answered (``__getattr__``)."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__getattr__ = _moved_names_getattr(module.__name__)


def message(old: str) -> str:
    """The warning for importing ``old``: what it is now and the import to write instead."""
    new = MOVED[old]
    return (
        f"{old} is deprecated: it moved to {new} (same names). Write `import {new}` / "
        f"`from {new} import ...` instead; the old path keeps working, with this warning, "
        f"until xtuner-rope {REMOVED_IN}."
    )


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old name as the new module object (nothing is executed twice)."""

    def create_module(self, spec):
        # stacklevel 2 skips importlib's own frames: the warning points at the importing line.
        warnings.warn(message(spec.name), DeprecationWarning, stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        """Nothing to run: the new module was executed by its own import."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of ``MOVED`` and the modules of ``MOVED_NAMES`` on ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in {module for module, _ in MOVED_NAMES}:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _MovedNamesLoader(spec.loader)
            return spec
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader())


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (first, so no stale file could shadow it)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
    for module, _ in MOVED_NAMES:  # imported before the finder was there
        if module in sys.modules and "__getattr__" not in vars(sys.modules[module]):
            sys.modules[module].__getattr__ = _moved_names_getattr(module)
