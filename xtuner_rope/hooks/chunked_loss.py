"""The chunked training loss switched on for the run (``chunked_loss``, on by default).

``ValidatedRoPEHook.before_train`` calls :func:`enable_chunked_loss`, which routes each model
kind's loss (SFT, LLaVA, InternVL, DPO/ORPO, SFT's held-out ``predict``) through
``models.chunked_loss``; where it cannot serve, the model's own loss runs and the log says why.
docs/loss.md has the models and the ``chunked_loss`` setting.
"""

from __future__ import annotations

from xtuner_rope.compat.guard import applied
from xtuner_rope.config.loss import CHUNKED_LOSS_OPT_OUT as OPT_OUT
from xtuner_rope.config.loss import chunked_loss_setting
from xtuner_rope.models.chunked_loss import (
    UnsupportedHead,
    is_chunked,
    is_target_logprobs,
    loss_only,
    patch_chunked_loss,
    shifted_targets,
    target_logprobs_only,
)
from xtuner_rope.models.dispatch import language_model, unwrap_model
from xtuner_rope.models.internvl import internvl_chat_model, llm_computes_the_loss

# XTuner models served -> the block their compute_loss runs in: SFT and LLaVA read outputs.loss
# (InternVL its LLM's, through its forward, below), DPO and ORPO the log-probs of the targets.
SERVED_MODELS = {
    "SupervisedFinetune": loss_only,
    "LLaVAModel": loss_only,
    "InternVL_V1_5": loss_only,
    "DPO": target_logprobs_only,
    "ORPO": target_logprobs_only,
}
_PREFERENCE_PATCH = "patch_preference_chunked_logprobs"

__all__ = ["enable_chunked_loss"]


def _why_not(runner, model) -> str | None:
    name = type(model).__name__
    if name not in SERVED_MODELS:
        return f"{name}'s loss is not served by the chunked loss yet"
    if SERVED_MODELS[name] is target_logprobs_only and _PREFERENCE_PATCH not in applied():
        return f"{_PREFERENCE_PATCH} was skipped (see its CompatPatchSkipped warning)"
    own = vars(model).get("compute_loss")
    if own is not None and not any(
        getattr(own, f"xtuner_rope_{what}", 0) for what in ("chunked", "dialogue")
    ):
        return "its compute_loss is replaced by code that reads the full logits"
    return None


def _predict_target_logprobs(own):
    """Wrap XTuner's SFT ``predict``: per row ``{"target_logprobs": [s]}``, position ``t``'s
    log-prob of ``labels[t + 1]`` (0 where -100 and at the end), from the chunked path."""

    def predict(data, data_samples=None):
        labels = data.get("labels")
        if labels is None:
            return own(data, data_samples)
        targets = shifted_targets(labels)  # [b, s]: what position t predicts
        with target_logprobs_only():
            rows = own({**data, "labels": targets}, data_samples)
            chunked = all(is_target_logprobs(row["logits"]) for row in rows)
        if not chunked:  # the model's own forward ran (paused): its logits, as without us
            return rows
        return [{"target_logprobs": row["logits"][:, 0]} for row in rows]

    return predict


def enable_chunked_loss(runner) -> str:
    """Switch the run's training loss (its model patched by ``models.dispatch.patch_model``) to the
    chunked loss where it serves; returns the start-up line saying which loss runs (and the chunk,
    or why not chunked).

    Raises:
        ValueError: a bad ``chunked_loss`` value (the start-up refuses it earlier).
    """
    setting = chunked_loss_setting(getattr(runner, "cfg", {}))
    if setting is False:
        return f"xtuner-rope: {OPT_OUT}: the model's own loss (full logits) runs."
    model = unwrap_model(runner.model)
    why = _why_not(runner, model)
    block = SERVED_MODELS.get(type(model).__name__)
    chunk = None if setting is True else setting
    if why is None:
        try:
            what = patch_chunked_loss(language_model(runner.model), chunk)
            if getattr(model, "ref_llm", None) is not None:  # DPO's reference model
                patch_chunked_loss(model.ref_llm, chunk)
        except UnsupportedHead as error:
            why = str(error)
    if why is not None:
        return f"xtuner-rope: the model's own loss (full logits) runs: {why}."
    sft = type(model).__name__ == "SupervisedFinetune"
    if internvl_chat_model(model) is not None:
        _serve_internvl(model)
    elif not getattr(vars(model).get("compute_loss"), "xtuner_rope_chunked", False):
        own = model.compute_loss

        def compute_loss(data, data_samples=None):
            with block():
                return own(data, data_samples)

        compute_loss.xtuner_rope_chunked = True
        model.compute_loss = compute_loss
        if sft:
            model.predict = _predict_target_logprobs(model.predict)
    assert is_chunked(language_model(runner.model))
    served = "the training loss" if block is loss_only else f"{type(model).__name__}'s log-probs"
    also = ", the held-out log-probs too" if sft else ""
    return (
        f"xtuner-rope: chunked loss: {served} projects only the supervised tokens "
        f"through the head ({what}){also}; opt out: {OPT_OUT}."
    )


def _serve_internvl(model) -> None:
    """``InternVL_V1_5.forward`` (training): XTuner's with ``labels=None``, the LLM given them."""
    if getattr(vars(model).get("forward"), "xtuner_rope_chunked", False):
        return
    own, chat = model.forward, internvl_chat_model(model)

    def forward(data, data_samples=None, mode="loss"):
        if mode != "loss" or data.get("labels") is None:
            return own(data, data_samples, mode)
        with loss_only(), llm_computes_the_loss(chat, data["labels"]) as got:
            out = own({**data, "labels": None}, data_samples, mode)
        assert "output" in got, "InternVL_V1_5's forward did not call its language_model"
        return {**out, "loss": got["output"].loss}

    forward.xtuner_rope_chunked = True
    model.forward = forward
