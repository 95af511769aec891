"""Token-weighted loss: the optimizer step is the same however dialogues are grouped.

XTuner 0.2.0's ``SupervisedFinetune`` returns the *mean* token loss of each micro-batch;
MMEngine's ``OptimWrapper`` divides it by ``accumulative_counts`` (by the remainder in a last
incomplete window); DDP and DeepSpeed average gradients over the ranks. A token's weight in the
step is then ``1 / (supervised tokens of its micro-batch)``: packing, batch size, accumulation
and the number of ranks change how much each dialogue trains.

With :class:`TokenWeightedLossHook` (added by the start-up) the step's loss is instead

    sum of the token losses of all micro-batches of the step on all ranks
    / number of supervised tokens in all of them,

the loss of one big unpadded batch of the same dialogues. How, at no extra pass or forward:

- each micro-batch's mean loss is multiplied by its own supervised-token count ``n`` (a sum of
  token losses) before backward, in place of MMEngine's division by the accumulation count;
- at the step, before gradient clipping, the accumulated gradients are rescaled once by
  ``(what the wrapper divided by: ranks, DeepSpeed's accumulation steps) / N`` with ``N`` the
  window's supervised tokens summed over ranks: one all-reduce of one number per step.

MMEngine ``OptimWrapper`` (and subclasses, DDP) get their grads multiplied before ``step``
clips; DeepSpeed ZeRO divides its gradients by its loss scale (the same division clips and
reports the norm), so the factor is handed to it as the loss scale of that one step.

The logged ``loss`` is unchanged: each micro-batch's mean token loss, as XTuner logs it.
Opt out with ``loss_normalization = "micro_batch"`` in the config (XTuner's own weighting).
"""

from __future__ import annotations

import torch
from mmengine.dist import all_reduce, get_world_size
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.optim import OptimWrapper

from xtuner_rope.batch.checks import batch_data
from xtuner_rope.config.startup import Finding, register_findings
from xtuner_rope.models.dispatch import unwrap_model

# The one setting (top level of the config) and its values.
LOSS_NORMALIZATION_KEY = "loss_normalization"
TOKEN, MICRO_BATCH = "token", "micro_batch"
LOSS_NORMALIZATIONS = (TOKEN, MICRO_BATCH)
IGNORE_INDEX = -100  # XTuner's and transformers' label of an unsupervised token
# XTuner models whose loss is a mean over supervised tokens (preference losses are not).
TOKEN_MEAN_MODELS = ("SupervisedFinetune",)
OPT_OUT = f'{LOSS_NORMALIZATION_KEY} = "{MICRO_BATCH}"'


def supervised_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss: labels other than -100 after the causal shift.

    Args:
        labels: ``[b, s]`` XTuner labels (the model shifts them: position ``i`` predicts
            ``labels[:, i + 1]``, so the first column never counts).

    Returns:
        The count the model's mean loss divides by.
    """
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def loss_normalization(cfg: object) -> str:
    """The config's ``loss_normalization`` (default ``"token"``), checked.

    Raises:
        ValueError: an unknown value; the message lists the accepted ones.
    """
    # MMEngine's Config is no Mapping, but has ``get``; a runner built in code has a dict.
    mode = cfg.get(LOSS_NORMALIZATION_KEY, TOKEN) if hasattr(cfg, "get") else TOKEN
    if mode not in LOSS_NORMALIZATIONS:
        raise ValueError(f"{LOSS_NORMALIZATION_KEY}: expected one of {LOSS_NORMALIZATIONS}, got "
                         f"{mode!r}. Set it at the top level of the config, or delete it for "
                         f'the default "{TOKEN}".')
    return mode


@register_findings(order=30)
def loss_normalization_findings(cfg) -> list:
    """Start-up check (``startup.inspect_config``): an unknown ``loss_normalization`` is a
    conflict, refused before anything is built."""
    mode = cfg._cfg_dict.get(LOSS_NORMALIZATION_KEY, TOKEN)
    if mode in LOSS_NORMALIZATIONS:
        return []
    return [Finding(LOSS_NORMALIZATION_KEY, f"expected one of {LOSS_NORMALIZATIONS}, got {mode!r}",
                    f'set {LOSS_NORMALIZATION_KEY} = "{TOKEN}" (the default: every supervised '
                    f'token of a step weighs the same) or "{MICRO_BATCH}" (XTuner\'s '
                    "per-micro-batch mean)")]


class TokenWeightedLossHook(Hook):
    """Weight every supervised token of an optimizer step equally, on every rank.

    Wraps the runner's optimizer wrapper for the run (``before_train``; undone in
    ``after_train``): see the module docstring. Reads ``labels`` of each ``data_batch`` in
    ``before_train_iter`` (CPU tensors: no device sync). Does nothing with
    ``loss_normalization = "micro_batch"`` in the config, or for a model whose loss is not a
    token mean (DPO, ORPO, reward models: logged).
    """

    priority = "NORMAL"  # 50: any place works; it only counts labels before the train step

    def __init__(self) -> None:
        self.active = False
        self._pending: int | None = None  # the next micro-batch's supervised tokens
        self._window = 0  # supervised tokens of this rank since the last step
        self._saved: dict[str, object] = {}
        self._optim_wrapper = None

    def before_train(self, runner) -> None:
        mode = loss_normalization(runner.cfg)
        model = unwrap_model(runner.model)
        if mode == MICRO_BATCH:
            print_log(f"xtuner-rope: {OPT_OUT}: each micro-batch's mean loss, averaged over "
                      "accumulation steps and ranks (XTuner's weighting).", logger="current")
            return
        if type(model).__name__ not in TOKEN_MEAN_MODELS:
            print_log(f"xtuner-rope: token-weighted loss not applied: {type(model).__name__}'s "
                      "loss is not a mean over supervised tokens.", logger="current")
            return
        self.wrap(runner.optim_wrapper)
        print_log("xtuner-rope: token-weighted loss: every optimizer step weights each "
                  "supervised token equally over all its micro-batches and ranks (sum of token "
                  "losses / supervised tokens); the logged loss is still each micro-batch's "
                  f"mean. Opt out: {OPT_OUT}.", logger="current")

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if self.active:
            labels = batch_data(data_batch, "TokenWeightedLossHook").get("labels")
            if not isinstance(labels, torch.Tensor):
                raise TypeError("TokenWeightedLossHook: the batch has no 'labels' tensor to "
                                f'count supervised tokens in; set {OPT_OUT} to train without it.')
            self._pending = supervised_tokens(labels)

    def after_train(self, runner) -> None:
        for name in self._saved:
            delattr(self._optim_wrapper, name)  # the class's methods again
        self._saved, self.active = {}, False

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
            raise TypeError(f"TokenWeightedLossHook: optim_wrapper {type(optim_wrapper).__name__}"
                            " is not supported (MMEngine OptimWrapper and subclasses, "
                            f"DeepSpeedOptimWrapper); set {OPT_OUT} to train without it.")
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
                engine.gradient_accumulation_steps() * get_world_size())
            zero.custom_loss_scaler = True
            try:
                return step(**kwargs)
            finally:
                zero.custom_loss_scaler, zero.external_loss_scale = False, None

        if not hasattr(optim_wrapper.model.optimizer, "custom_loss_scaler"):
            raise TypeError("TokenWeightedLossHook: DeepSpeed without ZeRO (stage 0) is not "
                            f"supported; use ZeRO-1/2/3 or set {OPT_OUT}.")
        self._patch("update_params", deepspeed_update_params)
        self._patch("step", deepspeed_step)

    def _patch(self, name: str, fn) -> None:
        self._saved[name] = getattr(self._optim_wrapper, name)
        setattr(self._optim_wrapper, name, fn)

    def _take_pending(self) -> int:
        assert self._pending is not None, "a train step without before_train_iter"
        count, self._pending = self._pending, None
        self._window += count
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
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)


__all__ = ["LOSS_NORMALIZATIONS", "LOSS_NORMALIZATION_KEY", "TokenWeightedLossHook",
           "loss_normalization", "loss_normalization_findings", "supervised_tokens"]
