"""The chunked training loss switched on for the run (``chunked_loss``, on by default).

``ValidatedRoPEHook.before_train`` calls :func:`enable_chunked_loss` after patching the model:
XTuner's ``SupervisedFinetune`` gets an instance ``compute_loss`` that runs its own inside
``models.chunked_loss.loss_only``, and its causal LM the chunked-loss ``forward``, so the loss
of every training step is ``ops.chunked_loss.chunked_causal_lm_loss`` (no ``[tokens, vocab]``
logits of the row), under sequence parallel too (``models.sequence_parallel``: each rank's
shard). What runs is logged once. Where the chunked loss cannot serve (another XTuner model,
``loss_normalization = "dialogue"``, a head it does not know, a LoRA head under ZeRO-3),
the model's own loss runs and the log says why.

The setting, at the top level of the config (read and checked by ``config.loss``):
``chunked_loss = False`` (the model's own loss), ``True`` (the default: chunks of
``ops.chunked_loss.CHUNK_BYTES`` of fp32 logits) or a number of tokens per chunk.
"""

from __future__ import annotations

from xtuner_rope.config.loss import CHUNKED_LOSS_OPT_OUT as OPT_OUT
from xtuner_rope.config.loss import chunked_loss_setting
from xtuner_rope.models.chunked_loss import (
    UnsupportedHead,
    is_chunked,
    loss_only,
    patch_chunked_loss,
)
from xtuner_rope.models.dispatch import language_model, unwrap_model

SERVED_MODELS = ("SupervisedFinetune",)  # XTuner models whose compute_loss reads outputs.loss

__all__ = ["enable_chunked_loss"]


def _why_not(runner, model) -> str | None:
    name = type(model).__name__
    if name not in SERVED_MODELS:
        return f"{name}'s loss is not served by the chunked loss yet"
    if "compute_loss" in vars(model) and not getattr(model.compute_loss, "xtuner_rope_chunked", 0):
        return 'loss_normalization = "dialogue" computes its loss from the full logits'
    return None


def enable_chunked_loss(runner) -> str:
    """Switch the run's training loss to the chunked loss where it serves; the log line.

    Args:
        runner: The MMEngine runner, its model patched by ``models.dispatch.patch_model``.

    Returns:
        The start-up line saying which loss runs (and the chunk, or why not chunked).

    Raises:
        ValueError: a bad ``chunked_loss`` value (the start-up refuses it earlier).
    """
    setting = chunked_loss_setting(getattr(runner, "cfg", {}))
    if setting is False:
        return f"xtuner-rope: {OPT_OUT}: the model's own loss (full logits) runs."
    model = unwrap_model(runner.model)
    why = _why_not(runner, model)
    if why is None:
        try:
            what = patch_chunked_loss(
                language_model(runner.model), None if setting is True else setting
            )
        except UnsupportedHead as error:
            why = str(error)
    if why is not None:
        return f"xtuner-rope: the model's own loss (full logits) runs: {why}."
    if not getattr(vars(model).get("compute_loss"), "xtuner_rope_chunked", False):
        own = model.compute_loss

        def compute_loss(data, data_samples=None):
            with loss_only():
                return own(data, data_samples)

        compute_loss.xtuner_rope_chunked = True
        model.compute_loss = compute_loss
    assert is_chunked(language_model(runner.model))
    return (
        f"xtuner-rope: chunked loss: the training loss projects only the supervised tokens "
        f"through the head ({what}); opt out: {OPT_OUT}."
    )
