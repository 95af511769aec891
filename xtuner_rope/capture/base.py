"""The one shape of every capture hook: do something at iteration N, undo it, save, log."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from mmengine.hooks import Hook
from mmengine.logging import print_log


class CaptureHook(Hook):
    """Base of the capture hooks: :meth:`install` at the 0-based iteration ``at_iter``, undo, save,
    log. Subclasses implement :meth:`install` (undo actions go to :meth:`on_undo`), :meth:`saved`,
    :meth:`file_name` and :meth:`message`."""

    # After ValidatedRoPEHook (5), before PackedBatchCheckHook (8), which pops the boundaries.
    priority = 7

    def __init__(self, at_iter: int = 0) -> None:
        self.at_iter = at_iter
        self._undo: list[Callable[[], None]] = []
        self._installed = False

    def install(self, runner, data_batch: dict) -> None:
        """Start recording the step (called in ``before_train_iter`` of ``at_iter``)."""
        raise NotImplementedError

    def saved(self, runner, outputs: dict | None) -> object:
        """What is written to the file, after the step."""
        raise NotImplementedError

    def file_name(self) -> str:
        """The capture's file name in the run's work dir."""
        raise NotImplementedError

    def message(self, path: Path, saved: object) -> str:
        """The log line after saving (the hook's class name is put in front)."""
        return f"saved iteration {self.at_iter + 1}'s capture to {path}."

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Register an action that undoes part of :meth:`install` after the step (in order)."""
        self._undo.append(undo)

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if runner.iter != self.at_iter or not isinstance(data_batch, dict):
            return
        self._installed = True
        self.install(runner, data_batch)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if not self._installed:
            return
        self._installed = False
        for undo in self._undo:
            undo()
        self._undo = []
        saved = self.saved(runner, outputs)
        path = Path(runner.work_dir) / self.file_name()
        torch.save(saved, path)
        print_log(f"{type(self).__name__}: {self.message(path, saved)}", logger="current")
