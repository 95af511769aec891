"""``xtuner-rope check`` on an InternVL config: each sample in its batch equals itself alone.

What reached the LLM of the real, patched ``InternVL_V1_5`` (``inputs_embeds``, mask,
positions) is run sample by sample through an unpatched copy: logits must match in fp32 within
1e-5 (relative), the same rows unpatched reported beside. Dropout is off.
"""

from __future__ import annotations

from pathlib import Path

import torch
from mmengine.config import Config

from xtuner_rope.capture.internvl import batch_loss, reference_internvl_llm
from xtuner_rope.capture.llava import isolation_figures
from xtuner_rope.capture.randomness import randomness_off
from xtuner_rope.check.runner import apply_patch, first_batches, prepared_runner
from xtuner_rope.models import channel
from xtuner_rope.models.chunked_loss import pause_chunked_loss
from xtuner_rope.models.dispatch import language_model
from xtuner_rope.models.internvl import internvl_image_tokens

KIND = "internvl"
TOLERANCE = 1e-5  # fp32, relative to max(1, |logit|)


def applies(cfg: Config) -> bool:
    """A config whose model is XTuner's ``InternVL_V1_5``."""
    from xtuner_rope.config.internvl import is_internvl

    return is_internvl(cfg)


def _llm_inputs(runner, hooks: dict, i: int, data_batch: dict) -> dict:
    """One batch through the patched ``InternVL_V1_5``: the LLM's inputs and logits."""
    llm = language_model(runner.model)
    seen: dict = {}

    def collect(module, args, kwargs, output):
        seen.update(
            {k: kwargs[k].detach() for k in ("inputs_embeds", "attention_mask", "position_ids")}
        )
        seen["logits"] = output.logits.detach().float().cpu()

    check = hooks.get("PackedBatchCheckHook")
    handle = llm.register_forward_hook(collect, with_kwargs=True)
    resume = pause_chunked_loss(llm)  # the check reads the training forward's logits
    try:
        channel.clear()  # no boundaries but this batch's (padded rows publish none)
        if check is not None:
            check.before_train_iter(runner, i, data_batch)  # publishes the rows' boundaries
        data = runner.model.data_preprocessor(data_batch, True)
        with torch.no_grad():
            runner.model(**data, mode="loss")
    finally:
        handle.remove()
        resume()
        if check is not None:
            check.after_train_iter(runner, i, data_batch, None)
    return seen


def _batch_result(reference, seen: dict, labels: torch.Tensor, ids: torch.Tensor, p) -> dict:
    saved = {
        **{k: v.float().cpu() if k == "inputs_embeds" else v.cpu() for k, v in seen.items()},
        "labels": labels.cpu(),
    }
    inputs = {k: seen[k] for k in ("inputs_embeds", "attention_mask", "position_ids")}
    with torch.no_grad():
        saved["unpatched_logits"] = reference(**inputs).logits.float().cpu()
    saved["loss"] = batch_loss(saved["logits"], saved["labels"])
    figures = isolation_figures(reference, saved)
    figures["image_tokens"] = int((ids == p[0]).sum()) if p else 0
    figures["within_tolerance"] = all(
        s["max_abs_diff"] <= TOLERANCE * max(1.0, s["max_abs_logit"]) for s in figures["per_sample"]
    )
    return figures


def run(cfg: Config, request) -> dict:
    """Measure a started InternVL config (the kind's entry in ``KINDS``); see the module docstring.

    Args: as :func:`xtuner_rope.check.text.run` (``batches`` and ``work_dir`` read).

    Returns:
        The JSON-ready report (``kind='internvl'``), with ``verdict``, ``problems`` and
        ``exit_code`` (0: every sample within tolerance).
    """
    # fp32 (XTuner loads bf16 on GPUs)
    runner, _, _, hooks = prepared_runner(cfg, Path(request.work_dir), "float32")
    llm = language_model(runner.model)
    reference = reference_internvl_llm(cfg)  # built before the patch: unpatched
    patched = apply_patch(runner, hooks)
    reference.load_state_dict(llm.state_dict())
    p = internvl_image_tokens(runner.model)
    results = []
    with randomness_off(runner.model) as randomness:
        for i, (data_batch, _) in enumerate(first_batches(cfg, request.batches)):
            data = data_batch["data"]
            seen = _llm_inputs(runner, hooks, i, data_batch)
            results.append(_batch_result(reference, seen, data["labels"], data["input_ids"], p))
    bad = [
        f"batch {b}, row {s['row']}, sample at column {s['start']}: max |batch - alone| "
        f"{s['max_abs_diff']:.3g} over {TOLERANCE:g} x max(1, |logit| {s['max_abs_logit']:.3g})"
        for b, r in enumerate(results)
        for s in r["per_sample"]
        if s["max_abs_diff"] > TOLERANCE * max(1.0, s["max_abs_logit"])
    ]
    chat = runner.model.model
    return {
        "kind": "internvl",
        "config": str(request.config),
        "plugin": {"patched": patched, "hooks": sorted(hooks)},
        "model": {
            "class": f"InternVL_V1_5({type(chat.vision_model).__name__} + {type(llm).__name__})",
            "path": str(cfg.model.model_path),
        },
        "multimodal": {
            "img_context_token_id": p[0] if p else None,
            "tokens_per_tile": p[1] if p else None,
        },
        "randomness": randomness,
        "batches": results,
        "problems": bad,
        "verdict": (
            "FAIL: " + bad[0]
            if bad
            else "PASS: each sample's LLM logits in the batch (vision tokens written in) equal "
            "the sample alone through the unpatched LLM"
        ),
        "exit_code": 1 if bad else 0,
    }


def summary(report: dict) -> str:
    """The text printed by ``xtuner-rope check`` for an InternVL config (``KINDS``)."""
    lines = [f"xtuner-rope check: {report['config']}", f"  model    {report['model']['class']}"]
    mm = report["multimodal"]
    lines.append(f"  images   {mm['tokens_per_tile']} LLM tokens per tile (checkpoint config)")
    for b, r in enumerate(report["batches"]):
        control = r["unpatched_max_abs_diff"]
        lines.append(
            f"  batch {b}  {r['samples']} samples in {r['rows']} rows ({r['image_tokens']} image "
            f"tokens): max |batch - alone| {r['max_abs_diff']:.3g}; same rows unpatched "
            f"{control:.3g}; loss {r['loss']['captured']:.6g} vs alone {r['loss']['samples']:.6g}"
        )
    lines.append(report["verdict"])
    return "\n".join(lines)
