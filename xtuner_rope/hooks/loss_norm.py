"""Token-weighted loss: the optimizer step is the same however dialogues are grouped.

XTuner 0.2.0 weighs a token ``1 / (supervised tokens of its micro-batch)``.
:class:`TokenWeightedLossHook` makes the step's loss the sum of all its token losses (all
micro-batches, all ranks) over their number: each micro-batch's mean times its count before
backward, the gradients rescaled once at the step. docs/optimizer-step.md has the details.
"""

from __future__ import annotations

import torch
from mmengine.dist import all_reduce, get_world_size
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.optim import OptimWrapper

from xtuner_rope.batch.checks import batch_data, row_boundaries
from xtuner_rope.batch.token_counts import IGNORE_INDEX, dialogue_weights, supervised_tokens
from xtuner_rope.config.loss import (
    DIALOGUE,
    LOSS_NORMALIZATION_KEY,
    MICRO_BATCH,
    TOKEN,
    loss_normalization,
)
from xtuner_rope.hooks.accumulation import check_resume, record_window
from xtuner_rope.models.chunked_loss import (
    is_chunked,
    is_target_logprobs,
    shifted_targets,
    target_logprobs_only,
)
from xtuner_rope.models.dispatch import unwrap_model

# XTuner models whose loss is a mean over supervised tokens, and over the pairs of a micro-batch.
# LLaVAModel: its LLM's loss over the expanded sequence; the image patches carry -100 and the
# placeholder they replace does too, so the batch's count is the expanded sequence's.
TOKEN_MEAN_MODELS = ("SupervisedFinetune", "LLaVAModel")
PAIR_MEAN_MODELS = ("DPO", "ORPO", "RewardModel")
NOT_PAIR_MEAN_DPO_LOSSES = ("kto_pair",)  # batch-level KL terms: no per-pair decomposition
OPT_OUT = f'{LOSS_NORMALIZATION_KEY} = "{MICRO_BATCH}"'


def preference_pairs(data: dict) -> int:
    """Preference pairs in one micro-batch of ``preference_collate_fn`` (what DPO / ORPO / reward
    losses average over): packed, half the responses of ``cumulative_len``; unpacked, half the
    rows of ``input_ids`` ``[2 * pairs, s]``.
    """
    cumulative = data.get("cumulative_len")
    if cumulative is not None:  # a sequence-parallel padding segment would be the odd one
        pairs = sum((len(bounds) - 1) // 2 for bounds in cumulative)
    else:
        pairs = int(data["input_ids"].shape[0]) // 2
    if pairs == 0:
        raise ValueError(
            f"preference_pairs: no pair in a batch of {tuple(data['input_ids'].shape)}"
            " input_ids (packed: cumulative_len, chosen then rejected per pair; "
            "unpacked: 2 rows per pair); was cumulative_len removed before "
            f"TokenWeightedLossHook ran? Set {OPT_OUT} to train without it."
        )
    return pairs


class TokenWeightedLossHook(Hook):
    """Weight every supervised token of an optimizer step equally, on every rank (module docstring).

    Wraps the runner's optimizer wrapper for the run; reads each batch's ``labels`` on the CPU.
    ``"micro_batch"`` (or a loss of no known mean, logged) leaves XTuner's weighting. In every
    mode it records the accumulation window, refusing a mid-window resume (``hooks.accumulation``).
    """

    # Before PackedBatchCheckHook (8) and XTuner's VarlenAttnArgsToMessageHubHook (50), which pop
    # ``cumulative_len`` (the pairs of a pack) out of the batch; it only reads the batch.
    priority = 4

    def __init__(self) -> None:
        self.active = False
        self.unit = "token"  # "pair" (preference models) or "dialogue" (that mode)
        self._reward_ranks = False  # RewardModel on several ranks: undo its rank-mean divisor
        self._dialogue_weights: torch.Tensor | None = None  # [b, s - 1], the next micro-batch
        self._patched_model = None
        self._pending: int | None = None  # the next micro-batch's supervised tokens
        self._window = 0  # supervised tokens of this rank since the last step
        self._saved: dict[str, object] = {}
        self._optim_wrapper = None

    def before_train(self, runner) -> None:
        check_resume(runner)  # a mid-window checkpoint is refused before any step
        mode = loss_normalization(runner.cfg)
        model = unwrap_model(runner.model)
        if mode == MICRO_BATCH:
            print_log(
                f"xtuner-rope: {OPT_OUT}: each micro-batch's mean loss, averaged over "
                "accumulation steps and ranks (XTuner's weighting).",
                logger="current",
            )
            return
        name = type(model).__name__
        if (
            name in PAIR_MEAN_MODELS
            and getattr(model, "loss_type", None) in NOT_PAIR_MEAN_DPO_LOSSES
        ):
            print_log(
                f"xtuner-rope: pair-weighted loss not applied: {name}'s loss_type "
                f"{model.loss_type!r} is not a mean over pairs.",
                logger="current",
            )
            return
        if name in PAIR_MEAN_MODELS:
            self.unit = "pair"
            self._reward_ranks = name == "RewardModel" and get_world_size() > 1
            self.wrap(runner.optim_wrapper)
            print_log(
                "xtuner-rope: pair-weighted loss: every optimizer step weights each "
                "preference pair equally over all its micro-batches and ranks (sum of pair "
                "losses / pairs); the logged loss is still each micro-batch's mean. Opt "
                f"out: {OPT_OUT}.",
                logger="current",
            )
            return
        if name not in TOKEN_MEAN_MODELS:
            print_log(
                f"xtuner-rope: token-weighted loss not applied: {name}'s "
                "loss is not a mean over supervised tokens.",
                logger="current",
            )
            return
        if mode == DIALOGUE:
            if name != "SupervisedFinetune":
                raise ValueError(
                    f'{LOSS_NORMALIZATION_KEY} = "{DIALOGUE}" serves XTuner\'s '
                    f"SupervisedFinetune only, got {name}; use the default "
                    f'"{TOKEN}".'
                )
            self.unit = "dialogue"
            self._patch_dialogue_loss(model)
            self.wrap(runner.optim_wrapper)
            print_log(
                'xtuner-rope: loss_normalization = "dialogue": every optimizer step '
                "weights each dialogue equally over all its micro-batches and ranks (mean "
                "over dialogues of each dialogue's mean token loss); the logged loss is "
                "each micro-batch's mean over its dialogues.",
                logger="current",
            )
            return
        self.wrap(runner.optim_wrapper)
        print_log(
            "xtuner-rope: token-weighted loss: every optimizer step weights each "
            "supervised token equally over all its micro-batches and ranks (sum of token "
            "losses / supervised tokens); the logged loss is still each micro-batch's "
            f"mean. Opt out: {OPT_OUT}.",
            logger="current",
        )

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if self.active and self.unit == "pair":
            self._pending = preference_pairs(batch_data(data_batch, "TokenWeightedLossHook"))
        elif self.active and self.unit == "dialogue":
            data = batch_data(data_batch, "TokenWeightedLossHook")
            labels = data.get("labels")
            bounds = (
                row_boundaries(data, labels.shape[0])
                if data.get("cumulative_len") is not None
                else None
            )
            self._dialogue_weights, self._pending = dialogue_weights(labels, bounds)
        elif self.active:
            labels = batch_data(data_batch, "TokenWeightedLossHook").get("labels")
            if not isinstance(labels, torch.Tensor):
                raise TypeError(
                    "TokenWeightedLossHook: the batch has no 'labels' tensor to "
                    f"count supervised tokens in; set {OPT_OUT} to train without it."
                )
            self._pending = supervised_tokens(labels)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        record_window(runner)  # before CheckpointHook (90) saves the message hub

    def after_train(self, runner) -> None:
        for name in self._saved:
            delattr(self._optim_wrapper, name)  # the class's methods again
        if self._patched_model is not None:
            del self._patched_model.compute_loss
            self._patched_model = None
        self._saved, self.active = {}, False

    # -- the per-dialogue loss ------------------------------------------------------------
    def _patch_dialogue_loss(self, model) -> None:
        """``model.compute_loss`` returns the micro-batch's mean over dialogues of their mean
        token loss from one forward: the chunked target log-probs where the chunked loss runs
        (``hooks.chunked_loss`` serves this ``compute_loss``), else the model's logits."""
        from xtuner.parallel.sequence import get_sequence_parallel_world_size

        if get_sequence_parallel_world_size() > 1:
            raise ValueError(
                f'{LOSS_NORMALIZATION_KEY} = "{DIALOGUE}" does not support '
                "sequence parallel yet; use the default "
                f'"{TOKEN}" with sequence_parallel_size > 1.'
            )

        def compute_loss(data, data_samples=None):
            weights, dialogues = self._dialogue_weights, self._pending
            assert weights is not None, "a train step without before_train_iter"
            self._dialogue_weights = None
            labels = data["labels"]
            inputs = {k: v for k, v in data.items() if k != "labels"}
            chunked = is_chunked(model.llm)
            if chunked:  # position t's target is labels[:, t + 1]
                with target_logprobs_only():
                    logits = model.llm(**inputs, labels=shifted_targets(labels)).logits
                    chunked = is_target_logprobs(logits)  # else paused: the model's logits
            else:
                logits = model.llm(**inputs).logits
            if chunked:
                tokens = -logits[:, :-1, 0].flatten()  # [b, s, 1] log-probs; 0 unsupervised
            else:
                tokens = torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(),
                    labels[:, 1:].flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="none",
                )
            weights = weights.to(tokens.device).flatten()
            return {"loss": (tokens * weights).sum() / max(dialogues, 1)}

        compute_loss.xtuner_rope_dialogue = True  # hooks.chunked_loss serves it
        model.compute_loss = compute_loss
        self._patched_model = model

    # -- the wrapping ---------------------------------------------------------------------
    def wrap(self, optim_wrapper) -> None:
        """Make ``optim_wrapper`` token-weighted (what ``before_train`` does, for SFT).

        Raises:
            TypeError: an optimizer wrapper this hook does not know.
        """
        self._optim_wrapper = optim_wrapper
        if isinstance(optim_wrapper, OptimWrapper):
            self._patch("scale_loss", lambda loss: loss * self._take_pending())
            step = optim_wrapper.step

            def mmengine_step(**kwargs):
                self._rescale_grads(optim_wrapper.optimizer, get_world_size() / self._total())
                return step(**kwargs)

            self._patch("step", mmengine_step)
        elif type(optim_wrapper).__name__ == "DeepSpeedOptimWrapper":
            self._wrap_deepspeed(optim_wrapper)
        else:
            raise TypeError(
                f"TokenWeightedLossHook: optim_wrapper {type(optim_wrapper).__name__}"
                " is not supported (MMEngine OptimWrapper and subclasses, "
                f"DeepSpeedOptimWrapper); set {OPT_OUT} to train without it."
            )
        self.active = True

    def _wrap_deepspeed(self, optim_wrapper) -> None:
        update, step = optim_wrapper.update_params, optim_wrapper.step

        def deepspeed_update_params(loss):
            return update(loss * self._take_pending())

        def deepspeed_step(**kwargs):
            engine = optim_wrapper.model
            if not engine.is_gradient_accumulation_boundary():
                return step(**kwargs)  # DeepSpeed only counts the micro-step
            # ZeRO divides gradients (and the norm it clips and reports) by its loss scale.
            zero = engine.optimizer
            zero.external_loss_scale = self._total() / (
                engine.gradient_accumulation_steps() * get_world_size()
            )
            zero.custom_loss_scaler = True
            try:
                return step(**kwargs)
            finally:
                zero.custom_loss_scaler, zero.external_loss_scale = False, None

        if not hasattr(optim_wrapper.model.optimizer, "custom_loss_scaler"):
            raise TypeError(
                "TokenWeightedLossHook: DeepSpeed without ZeRO (stage 0) is not "
                f"supported; use ZeRO-1/2/3 or set {OPT_OUT}."
            )
        self._patch("update_params", deepspeed_update_params)
        self._patch("step", deepspeed_step)

    def _patch(self, name: str, fn) -> None:
        self._saved[name] = getattr(self._optim_wrapper, name)
        setattr(self._optim_wrapper, name, fn)

    def _take_pending(self) -> float:
        """The factor that turns this micro-batch's mean loss into its sum (of token, pair or
        dialogue losses)."""
        assert self._pending is not None, "a train step without before_train_iter"
        count, self._pending = self._pending, None
        self._window += count
        if self._reward_ranks:
            # RewardModel's loss is sum * mean over ranks of 1 / pairs (xtuner/model/reward.py)
            inverse = torch.tensor(1.0 / max(count, 1), dtype=torch.float64)
            all_reduce(inverse, op="mean")
            return 1.0 / inverse.item() if count else 0.0
        return count

    def _total(self) -> float:
        """Supervised tokens of the window on all ranks (the one all-reduce of the step)."""
        # MMEngine's all_reduce moves the number to the backend's device (NCCL: the GPU).
        total = torch.tensor(float(self._window), dtype=torch.float64)
        all_reduce(total)
        self._window = 0
        return max(total.item(), 1.0)  # a window without labels: zero gradients either way

    @staticmethod
    def _rescale_grads(optimizer: torch.optim.Optimizer, factor: float) -> None:
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if grads:
            torch._foreach_mul_(grads, factor)


__all__ = ["TokenWeightedLossHook", "preference_pairs"]
