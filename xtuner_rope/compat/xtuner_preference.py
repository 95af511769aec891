"""XTuner DPO/ORPO patches: rank without a process group, target id 0 counted."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import types

import torch


class _RankWithoutGroup:
    """``torch.distributed`` as xtuner's DPO/ORPO modules see it: rank 0 without a group."""

    def __init__(self, dist: types.ModuleType):
        self._dist = dist

    def __getattr__(self, name: str):
        return getattr(self._dist, name)

    def get_rank(self, group=None) -> int:
        return self._dist.get_rank(group) if self._dist.is_initialized() else 0


def patch_xtuner_preference_rank() -> bool:
    """Let a single-process ``xtuner train`` run XTuner's packed DPO and ORPO.

    xtuner 0.2.0 ``DPO.compute_loss`` / ``ORPO.compute_loss`` (``use_varlen_attn=True``) read
    the boundaries under ``cumulative_len_rank_{dist.get_rank()}`` with torch's ``get_rank``,
    which needs a process group: a plain ``xtuner train`` (no launcher) dies at the first step
    with ``ValueError: Default process group has not been initialized``. Their module's
    ``dist`` is swapped for a view of ``torch.distributed`` whose ``get_rank`` is 0 without a
    group (MMEngine's convention, the rank ``PackedBatchCheckHook`` publishes under).

    Returns:
        True if applied (an XTuner whose DPO/ORPO call ``dist.get_rank()`` there).
    """
    applied = False
    for name, cls in (("xtuner.model.dpo", "DPO"), ("xtuner.model.orpo", "ORPO")):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if module.__dict__.get(
            "dist"
        ) is torch.distributed and "dist.get_rank()" in inspect.getsource(
            getattr(module, cls).compute_loss
        ):
            module.dist = _RankWithoutGroup(torch.distributed)
            applied = True
    return applied


def _response_targets(labels: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: token ``t``'s target ``labels[:, t + 1]`` is supervised (not -100)."""
    targets = torch.zeros_like(labels, dtype=torch.bool)
    targets[:, :-1] = labels[:, 1:] != -100
    return targets


def _keep_target_id_zero(compute_loss):
    """Wrap ``compute_loss``: its gathered log-probs keep every supervised target, id 0 too."""

    @functools.wraps(compute_loss)
    def wrapped(self, data, data_samples=None):
        self._xtuner_rope_targets = _response_targets(data["labels"])
        try:
            return compute_loss(self, data, data_samples)
        finally:
            self._xtuner_rope_targets = None

    return wrapped


def _gather_with_targets(gather):
    """Wrap ``_gather_masked_logits``: the mask is the one recorded before -100 became 0."""

    @functools.wraps(gather)
    def wrapped(self, logits, labels, mask):
        targets = getattr(self, "_xtuner_rope_targets", None)
        if targets is not None and targets.shape != labels.shape:  # split for sequence parallel
            from xtuner.parallel.sequence import (
                get_sequence_parallel_group,
                split_for_sequence_parallel,
            )

            targets = split_for_sequence_parallel(
                targets, dim=1, sp_group=get_sequence_parallel_group()
            )
        return gather(self, logits, labels, mask if targets is None else targets.to(mask.device))

    return wrapped


def patch_xtuner_preference_target_zero() -> bool:
    """Count target token id 0 in XTuner's DPO/ORPO log-probs.

    xtuner 0.2.0 ``DPO.compute_loss`` / ``ORPO.compute_loss`` build the log-prob mask as
    ``labels[labels == -100] = 0; loss_mask = labels != 0``: every supervised target whose id
    is 0 (a real token in Llama 3 and Qwen2 vocabularies, "!") is silently left out of the
    chosen/rejected log-probs, while the IPO/ORPO denominators (``labels != -100``) still count
    it. The wrapped ``compute_loss`` records ``labels != -100`` (shifted as XTuner shifts)
    before XTuner overwrites the -100s, and ``_gather_masked_logits`` uses it.

    Returns:
        True if applied (an XTuner whose DPO/ORPO still build the mask that way).
    """
    applied = False
    for name, cls in (("xtuner.model.dpo", "DPO"), ("xtuner.model.orpo", "ORPO")):
        try:
            model = getattr(importlib.import_module(name), cls)
        except ImportError:
            continue
        if getattr(
            model.compute_loss, "_xtuner_rope_targets", False
        ) or "loss_mask = labels != 0" not in inspect.getsource(model.compute_loss):
            continue
        model.compute_loss = _keep_target_id_zero(model.compute_loss)
        model.compute_loss._xtuner_rope_targets = True
        model._gather_masked_logits = _gather_with_targets(model._gather_masked_logits)
        applied = True
    return applied
