"""``xtuner-rope check`` of a text (SFT) config: prove isolation on the user's own model and data.

For each of the first batches (:mod:`xtuner_rope.capture.measure`): (1) unpatched, each
document alone: logits, loss, gradients, greedy generation of the first prompt; (2) the
plugin's hooks run as in training; (3) patched, the packed batch through ``SupervisedFinetune``
as the training step calls it, against (1). Without the plugin the figures measure XTuner's leak.
"""

from __future__ import annotations

from pathlib import Path

from mmengine.config import Config

from xtuner_rope.capture import measure as cm
from xtuner_rope.capture.measure import BOUNDARY_HOOKS
from xtuner_rope.capture.randomness import describe, randomness_off
from xtuner_rope.check.chunked_loss import chunked_loss_lines, compare_chunked_loss
from xtuner_rope.check.report import TOLERANCES, judge, report_head
from xtuner_rope.check.runner import (
    CheckRequest,
    apply_patch,
    first_batches,
    prepared_runner,
)
from xtuner_rope.models.runtime import chosen_backends

KIND = "text"


def applies(cfg: Config) -> bool:
    """Every config: the text check is the last entry of ``KINDS``, the one left."""
    return True


def measure(runner, batches: list, hooks: dict, new_tokens: int, passes=None) -> dict:
    """Reference passes (unpatched), the patch, packed passes; see the module docstring.

    Gradients are compared on the first batch (one ``.grad`` buffer holds their difference);
    dropout and router noise are off (``randomness`` says what was switched off); ``backend``:
    what the patched attention chose (``models.runtime.chosen_backends``). ``passes``: what
    measures ``(runner, batches, hooks, new_tokens)`` (the LLaVA check's), default the text's.
    """
    model = runner.model
    model.train()
    model.zero_grad(set_to_none=True)
    with randomness_off(model) as randomness:
        measured = (passes or _measure)(runner, batches, hooks, new_tokens)
    return {**measured, "randomness": randomness}


def _measure(runner, batches: list, hooks: dict, new_tokens: int) -> dict:
    model, llm = runner.model, runner.model.llm
    refs = []
    for i, (data_batch, docs) in enumerate(batches):
        data = data_batch["data"]
        n_packed, n_docs = cm.label_count(data["labels"], docs)
        logits, loss = cm.documents_alone(llm, data, docs, n_packed, backward=i == 0)
        refs.append({"logits": logits, "loss": loss, "labels": (n_packed, n_docs)})
    ref_grad = cm.grad_scale(model)
    prompt = cm.prompt_of(batches[0][0]["data"], batches[0][1][0])
    generated_ref = cm.greedy(llm, prompt, new_tokens)
    patched = apply_patch(runner, hooks)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    tolerance = TOLERANCES[dtype]["loss"]
    chunked = compare_chunked_loss(runner, batches[0][0], hooks, tolerance) if patched else None
    chosen_backends(reset=True)
    results = []
    for i, ((data_batch, docs), ref) in enumerate(zip(batches, refs)):
        packed = cm.packed_forward(runner, data_batch, hooks, BOUNDARY_HOOKS, backward=i == 0)
        results.append(batch_result(data_batch, docs, ref, packed))
    out = outcome(runner, llm, patched, results, ref_grad, (prompt, generated_ref, new_tokens))
    return {**out, "chunked_loss": chunked}


def batch_result(data_batch: dict, docs: list, ref: dict, packed: tuple) -> dict:
    """One batch's entry: the packed pass's ``(logits, loss, unconsumed keys)`` against the
    reference ``ref`` of each document alone (``docs``: ``(row, start, end)`` each)."""
    logits, loss, dropped = packed
    b, s = data_batch["data"]["input_ids"].shape
    return {
        "rows": b,
        "tokens_per_row": s,
        "documents": len(docs),
        "labels": {"packed": ref["labels"][0], "documents": ref["labels"][1]},
        "logits": cm.logits_differences(logits, ref["logits"], docs),
        "loss": {"packed": loss, "documents": ref["loss"]},
        "unconsumed_keys": dropped,
    }


def outcome(runner, counted, patched: bool, results: list, ref_grad: float, generation) -> dict:
    """What the text and LLaVA checks measured, once the packed passes ran (``.grad`` zeroed).

    Args:
        counted: The module whose trainable parameters the gradients count.
        generation: ``(prompt [1, k], unpatched greedy tokens, new_tokens)``.
    """
    model, llm = runner.model, runner.model.llm
    diff = cm.grad_scale(model)  # the packed gradients minus the reference's
    model.zero_grad(set_to_none=True)
    prompt, unpatched, new_tokens = generation
    return {
        "patched": patched,
        "backend": ", ".join(chosen_backends(reset=True)) or None,
        "batches": results,
        "grads": {
            "max_abs_diff": diff,
            "max_abs_grad": ref_grad,
            "parameters": sum(p.numel() for p in counted.parameters() if p.requires_grad),
            "batch": 0,
        },
        "generation": {
            "prompt_tokens": prompt.shape[1],
            "unpatched": unpatched,
            "patched": cm.greedy(llm, prompt, new_tokens),
        },
    }


def run(cfg: Config, request: CheckRequest) -> dict:
    """Measure a started text config (the kind's entry in ``KINDS``; the module docstring): the
    JSON-ready report, with ``verdict``, ``problems`` and ``exit_code``."""
    prepared = prepared_runner(cfg, Path(request.work_dir), request.dtype)
    runner, hooks = prepared.runner, prepared.hooks
    cut, sources = [], []
    for data_batch, recorded in first_batches(cfg, request.batches):
        docs, source = cm.documents(data_batch["data"], recorded, request.max_documents)
        cut.append((data_batch, docs))
        sources.append(source)
    measured = measure(runner, cut, hooks, request.new_tokens)
    for result, source in zip(measured["batches"], sources):
        result["boundaries"] = source
    llm = runner.model.llm
    size = sum(p.numel() for p in llm.parameters())
    report = {**report_head(cfg, request, prepared, measured, type(llm).__name__, size), **measured}
    report.update(judge(report))
    return report


def summary(report: dict) -> str:
    """The short text printed by ``xtuner-rope check`` for a text (SFT) config (``KINDS``)."""
    m, fig, gen = report["model"], report["figures"], report["generation"]
    docs = sum(b["documents"] for b in report["batches"])
    rows = sum(b["rows"] for b in report["batches"])

    def ok(name: str) -> str:
        return "ok" if fig[name]["relative"] <= fig[name]["tolerance"] else "FAIL"

    lines = [
        f"xtuner-rope check: {report['config']}",
        f"  model    {m['class']} ({m['parameters']:,} parameters), {m['dtype']} on "
        f"{m['device']}, attn_implementation={m['attn_implementation']}, packed backend "
        f"{_backend(report)}",
        f"  random   {describe(report['randomness'])}",
        f"  batches  {len(report['batches'])}: {rows} rows, {docs} documents "
        f"(boundaries: {report['batches'][0]['boundaries']})",
        f"  logits   max |packed - alone| {fig['logits']['max_abs_diff']:.3g} "
        f"(relative {fig['logits']['relative']:.3g}, tolerance {fig['logits']['tolerance']:.3g})"
        f"  {ok('logits')}",
        f"  loss     packed {report['batches'][0]['loss']['packed']:.6f} vs documents "
        f"{report['batches'][0]['loss']['documents']:.6f} (relative {fig['loss']['relative']:.3g}"
        f", tolerance {fig['loss']['tolerance']:.3g})  {ok('loss')}",
        f"  grads    max |packed - sum of documents| {fig['grads']['max_abs_diff']:.3g} over "
        f"{report['grads']['parameters']:,} parameters (relative {fig['grads']['relative']:.3g}, "
        f"tolerance {fig['grads']['tolerance']:.3g})  {ok('grads')}",
        f"  generate {len(gen['patched'])} greedy tokens, patched "
        f"{'==' if gen['patched'] == gen['unpatched'] else '!='} unpatched  "
        f"{'ok' if gen['patched'] == gen['unpatched'] else 'FAIL'}",
        *chunked_loss_lines(report.get("chunked_loss")),
        *[f"  problem: {p}" for p in report["problems"]],
        report["verdict"],
    ]
    return "\n".join(lines)


def _backend(report: dict) -> str:
    """The backend the packed pass ran, and the attention layers it ran in."""
    m = report["model"]
    layers = ", ".join(m.get("attention_layers") or []) or "no attention layer found"
    if not report["plugin"]["patched"]:
        return f"none (not patched; layers {layers})"
    return f"{m['packed_backend'] or 'none (no packed row reached it)'} (layers {layers})"
