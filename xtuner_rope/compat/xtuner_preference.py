"""XTuner DPO/ORPO patches: rank without a process group, target id 0 counted, the log-probs
from the chunked target log-probs, the reference model's logits in DPO's ``predict``
(held-out evaluation)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import types

import torch

from xtuner_rope.models.chunked_loss import is_chunked, is_target_logprobs


def _preference_models():
    """``(module, class)`` of XTuner's DPO and ORPO, those that import."""
    for name, cls in (("xtuner.model.dpo", "DPO"), ("xtuner.model.orpo", "ORPO")):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        yield module, getattr(module, cls)


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

    xtuner 0.2.0's packed ``compute_loss`` calls ``dist.get_rank()``, which needs a process
    group (``Default process group has not been initialized`` without a launcher); their
    module's ``dist`` becomes a view whose ``get_rank`` is 0 without a group (as MMEngine's).
    """
    applied = False
    for module, model in _preference_models():
        if module.__dict__.get("dist") is not torch.distributed:
            continue
        if "dist.get_rank()" in inspect.getsource(model.compute_loss):
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

    xtuner 0.2.0 masks with ``labels[labels == -100] = 0; loss_mask = labels != 0``, dropping
    every target of id 0 (Llama 3's and Qwen2's "!") while the IPO/ORPO denominators count it;
    ``compute_loss`` now records ``labels != -100`` first and ``_gather_masked_logits`` uses it.
    """
    applied = False
    for _, model in _preference_models():
        if "loss_mask = labels != 0" not in inspect.getsource(model.compute_loss):
            continue
        model.compute_loss = _keep_target_id_zero(model.compute_loss)
        model._gather_masked_logits = _gather_with_targets(model._gather_masked_logits)
        applied = True
    return applied


def _gather_target_logprobs(gather):
    """Wrap ``_gather_masked_logits``: the chunked target log-probs are already gathered."""

    @functools.wraps(gather)
    def wrapped(self, logits, labels, mask):
        if is_target_logprobs(logits):  # [b, s, 1]
            return logits[..., 0] * mask
        return gather(self, logits, labels, mask)

    return wrapped


def _cross_entropy_from_logprobs(cross_entropy):
    """Wrap ORPO's ``cross_entropy_loss``: its mean NLL from the chunked target log-probs."""

    @functools.wraps(cross_entropy)
    def wrapped(self, logits, labels):
        if not is_target_logprobs(logits):
            return cross_entropy(self, logits, labels)
        # As XTuner: the last position (its dummy label) dropped, the mean over labels != -100.
        logp, labels = logits[..., :-1, 0], labels[..., :-1].to(logits.device)
        keep = labels != -100
        return -(logp * keep).sum() / keep.sum()

    return wrapped


def patch_preference_chunked_logprobs() -> bool:
    """XTuner's DPO and ORPO take their log-probs from the chunked target log-probs.

    Inside ``models.chunked_loss.target_logprobs_only`` the LLMs return ``[b, s, 1]`` target
    log-probs instead of ``[b, s, V]`` logits; ``_gather_masked_logits`` and ORPO's
    ``cross_entropy_loss`` accept both (same values and gradients). Applied before
    ``patch_xtuner_preference_target_zero``, whose wrapper hands it the mask.
    """
    from xtuner.model.dpo import DPO
    from xtuner.model.orpo import ORPO

    for cls in (DPO, ORPO):
        cls._gather_masked_logits = _gather_target_logprobs(cls._gather_masked_logits)
    ORPO.cross_entropy_loss = _cross_entropy_from_logprobs(ORPO.cross_entropy_loss)
    return True


def patch_preference_unpacked_pairs() -> bool:
    """``PackedDatasetWrapper`` keeps the pairs it packed, in dataset order (``unpacked_pairs``).

    xtuner 0.2.0 shuffles and drops pairs over ``max_packed_length`` with only a count;
    ``data.preference_checks`` needs them named (a reference, no copy).
    """
    try:
        from xtuner.dataset.preference_dataset import PackedDatasetWrapper
    except ImportError:
        return False
    init = PackedDatasetWrapper.__init__

    @functools.wraps(init)
    def keeping(self, dataset, *args, **kwargs):
        init(self, dataset, *args, **kwargs)
        self.unpacked_pairs = dataset

    PackedDatasetWrapper.__init__ = keeping
    return True


def _failing_row(dataset, map_fn) -> tuple[int, Exception] | None:
    for i in range(len(dataset)):
        try:
            map_fn(dataset[i])
        except Exception as exc:  # noqa: BLE001 - named in the caller's message
            return i, exc
    return None


def patch_preference_map_fn_errors() -> bool:
    """A preference ``dataset_map_fn`` that fails names the source row and what a pair needs.

    xtuner 0.2.0 dies with a bare ``AssertionError`` / ``KeyError`` (one-sided row, no answer
    turn, no ``rejected``); on failure the rows are mapped one by one and a ``ValueError``
    names the first that fails.
    """
    try:
        import xtuner.dataset.preference_dataset as preference
    except ImportError:
        return False
    original = preference.map_dataset

    @functools.wraps(original)
    def named(dataset, dataset_map_fn, map_num_proc):
        try:
            return original(dataset, dataset_map_fn, map_num_proc)
        except Exception as exc:
            fn = dataset_map_fn
            if isinstance(fn, str):  # a name of XTuner's MAP_FUNC
                fn = preference.MAP_FUNC.get(fn)
            found = _failing_row(dataset, fn) if callable(fn) else None
            if found is None:
                raise
            row, error = found
            name = getattr(fn, "__name__", str(dataset_map_fn))
            raise ValueError(
                f"build_preference_dataset: source row {row}: dataset_map_fn {name} failed "
                f"({type(error).__name__}: {error or 'assertion'}). Expected a pair: 'chosen' "
                "and 'rejected' conversations with the same turns, each ending with its own "
                "assistant answer. Fix or remove the row."
            ) from exc

    preference.map_dataset = named
    return True


def _predict_with_reference(self, data, data_samples=None):
    """Per row: the policy's logits ``[s, V]`` and the reference model's (``ref_logits``); with
    the chunked loss the ``labels`` are the targets whose log-probs the LLMs return instead."""
    chunked = is_chunked(self.llm)  # else no labels: the model's HF loss is not used here
    inputs = {k: v for k, v in data.items() if k != "labels" or chunked}
    policy = self.llm(**inputs).logits  # [b, s, V]
    with torch.no_grad():
        if self.ref_llm is None:  # LoRA: the reference is the policy without its adapter
            with self.llm.disable_adapter():
                reference = self.llm(**inputs).logits
        else:
            reference = self.ref_llm(**inputs).logits
    return [{"logits": p, "ref_logits": r} for p, r in zip(policy, reference)]


def patch_dpo_predict_reference() -> bool:
    """XTuner's DPO ``predict`` (its ``val_step``) returns the reference model's logits too.

    xtuner 0.2.0 inherits ``SupervisedFinetune.predict`` (policy only); ``PreferenceMetric``
    needs ``ref_logits`` ``[s, V]`` per row (``ref_llm``, or LoRA's adapter disabled).
    """
    try:
        from xtuner.model.dpo import DPO
    except ImportError:
        return False
    if DPO.__dict__.get("predict", _predict_with_reference) is not _predict_with_reference:
        return False  # a newer XTuner with its own: leave it
    DPO.predict = _predict_with_reference
    return True


def patch_preference_truncation_counted(counted_class) -> bool:
    """Count XTuner's cut of preference responses at ``max_length`` (same pairs).

    xtuner 0.2.0 ``PreferenceDataset`` cuts prompt + response at ``max_length`` silently; the
    module's class becomes ``counted_class(PreferenceDataset)``, a subclass that counts
    (``data.preference_truncation.counted_preference_dataset``).
    """
    import xtuner.dataset.preference_dataset as preference

    if not hasattr(preference.PreferenceDataset, "xtuner_class"):
        preference.PreferenceDataset = counted_class(preference.PreferenceDataset)
    return True
