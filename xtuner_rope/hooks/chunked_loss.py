"""The chunked training loss switched on for the run (``chunked_loss``, on by default).

``ValidatedRoPEHook.before_train`` calls :func:`enable_chunked_loss`, which routes each model
kind's loss (SFT, LLaVA, InternVL, DPO/ORPO) and held-out ``predict`` through
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


def _target_logprobs(run, labels):
    """The held-out rows of ``run(shifted_targets(labels))`` in :func:`target_logprobs_only`:
    each ``<p>logits`` ``[s, 1]`` (DPO: ``ref_logits`` too) becomes ``<p>target_logprobs`` ``[s]``
    (paused: the logits stay); a row's ``labels`` (LLaVA's expanded ones) are ``labels``' again."""
    with target_logprobs_only():
        rows = run(shifted_targets(labels))
        keys = [k for k in rows[0] if k.endswith("logits")]
        chunked = all(is_target_logprobs(row[k]) for row in rows for k in keys)
    for r, row in enumerate(rows):
        if "labels" in row:
            row["labels"] = labels[r]
        for key in keys if chunked else ():
            row[key.replace("logits", "target_logprobs")] = row.pop(key)[:, 0]
    return rows


def _predict_target_logprobs(own):
    """Wrap a ``predict`` that calls the LLM(s) with ``data``: XTuner's SFT, ORPO, LLaVA's
    (``compat.xtuner_llava``), DPO's (``compat.xtuner_preference``); see :func:`_target_logprobs`."""

    def predict(data, data_samples=None):
        labels = data.get("labels")
        if labels is None:
            return own(data, data_samples)
        return _target_logprobs(lambda t: own({**data, "labels": t}, data_samples), labels)

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
    if internvl_chat_model(model) is not None:
        _serve_internvl(model)
    elif not getattr(vars(model).get("compute_loss"), "xtuner_rope_chunked", False):
        own = model.compute_loss

        def compute_loss(data, data_samples=None):
            with block():
                return own(data, data_samples)

        compute_loss.xtuner_rope_chunked = True
        model.compute_loss = compute_loss
        model.predict = _predict_target_logprobs(model.predict)
    assert is_chunked(language_model(runner.model))
    served = "the training loss" if block is loss_only else f"{type(model).__name__}'s log-probs"
    return (
        f"xtuner-rope: chunked loss: {served} projects only the supervised tokens "
        f"through the head ({what}), the held-out log-probs too; opt out: {OPT_OUT}."
    )


def _serve_internvl(model) -> None:
    """``InternVL_V1_5.forward``: XTuner's with ``labels=None``, the LLM given them (training),
    or their shifted targets (``mode="predict"``: :func:`_target_logprobs`)."""
    if getattr(vars(model).get("forward"), "xtuner_rope_chunked", False):
        return
    own, chat = model.forward, internvl_chat_model(model)

    def predict(data, data_samples, targets):
        with llm_computes_the_loss(chat, targets):
            return own({**data, "labels": None}, data_samples, "predict")

    def forward(data, data_samples=None, mode="loss"):
        labels = data.get("labels")
        if mode == "predict" and labels is not None:
            return _target_logprobs(lambda targets: predict(data, data_samples, targets), labels)
        if mode != "loss" or labels is None:
            return own(data, data_samples, mode)
        with loss_only(), llm_computes_the_loss(chat, labels) as got:
            out = own({**data, "labels": None}, data_samples, mode)
        assert "output" in got, "InternVL_V1_5's forward did not call its language_model"
        return {**out, "loss": got["output"].loss}

    forward.xtuner_rope_chunked = True
    model.forward = forward
