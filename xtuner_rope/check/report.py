"""Verdict, tolerances, printed summary and ``report.json`` of ``xtuner-rope check``.

Tolerances are relative to the size of what is compared (``max(1, |reference|)``): a packed
document and the same document alone run the same weights through different kernel calls
(bucketed or varlen attention against one dense call), so their results differ by rounding
only, and rounding scales with the values. fp32: 1e-5 for logits and loss, 1e-4 for
gradients (sums over every token of the batch, in a different order). bf16/fp16: 8 units in
the last place of the dtype (bf16 2^-8 * 8 = 0.031, fp16 2^-11 * 8 = 0.0039), because the
patched model rotates q/k in fp32 while the reference rounds its cos/sin to the activation
dtype, and each of the model's matmuls rounds its output once more. A leak is not rounding:
a document that sees another one moves its logits by whole units (measured 0.2 to 2 on the
tiny models), far above every tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

from xtuner_rope.config.startup import MODEL_RESOURCE_EDIT
from xtuner_rope.doctor.check_randomness import describe

TOLERANCES = {  # relative, see the module docstring
    "float32": {"logits": 1e-5, "loss": 1e-5, "grads": 1e-4},
    "bfloat16": {"logits": 8 * 2**-8, "loss": 8 * 2**-8, "grads": 8 * 2**-8},
    "float16": {"logits": 8 * 2**-11, "loss": 8 * 2**-11, "grads": 8 * 2**-11},
}


def _worst_document(report: dict) -> dict:
    docs = [dict(d, batch=i) for i, b in enumerate(report["batches"]) for d in b["logits"]]
    return max(docs, key=lambda d: d["max_abs_diff"] / max(1.0, d["max_abs_logit"]))


def figures(report: dict) -> dict:
    """The headline differences, each ``diff / scale`` next to its tolerance."""
    tol = TOLERANCES[report["model"]["dtype"]]
    worst = _worst_document(report)
    losses = [b["loss"] for b in report["batches"]]
    loss = max(losses, key=lambda x: abs(x["packed"] - x["documents"]))
    grads = report["grads"]
    return {
        "logits": {
            "max_abs_diff": worst["max_abs_diff"],
            "tolerance": tol["logits"],
            "relative": worst["max_abs_diff"] / max(1.0, worst["max_abs_logit"]),
            "worst_document": {k: worst[k] for k in ("batch", "row", "start", "tokens")},
        },
        "loss": {
            "abs_diff": abs(loss["packed"] - loss["documents"]),
            "tolerance": tol["loss"],
            "relative": abs(loss["packed"] - loss["documents"]) / max(1.0, abs(loss["documents"])),
        },
        "grads": {
            "max_abs_diff": grads["max_abs_diff"],
            "tolerance": tol["grads"],
            "relative": grads["max_abs_diff"] / max(grads["max_abs_grad"], 1e-30),
        },
    }


def judge(report: dict) -> dict:
    """``figures``, ``problems``, ``verdict`` and ``exit_code`` (1 on any problem)."""
    fig = figures(report)
    problems = []
    if fig["logits"]["relative"] > fig["logits"]["tolerance"]:
        w = fig["logits"]["worst_document"]
        problems.append(
            f"logits: a packed document differs from the same document alone by "
            f"{fig['logits']['max_abs_diff']:.3g} (batch {w['batch']}, row {w['row']}, tokens "
            f"{w['start']}..{w['start'] + w['tokens']}): documents attend to each other"
        )
    for name in ("loss", "grads"):
        if fig[name]["relative"] > fig[name]["tolerance"]:
            problems.append(
                f"{name}: packed differs from the documents' by "
                f"{fig[name]['relative']:.3g} (relative)"
            )
    for i, b in enumerate(report["batches"]):
        if b["labels"]["packed"] != b["labels"]["documents"]:
            problems.append(
                f"batch {i}: {b['labels']['packed'] - b['labels']['documents']} "
                "label(s) on a document's first token: the packed loss predicts "
                "them from the previous document"
            )
        if b["unconsumed_keys"]:
            problems.append(
                f"batch {i}: {', '.join(b['unconsumed_keys'])} reached the model: "
                "no hook consumes the boundaries (training would refuse the batch)"
            )
    gen = report["generation"]
    if gen["patched"] != gen["unpatched"]:
        problems.append(f"generation: patched {gen['patched']} != unpatched {gen['unpatched']}")
    if problems and not report["plugin"]["patched"]:
        problems.append(
            "xtuner-rope's patch is not applied (no ValidatedRoPEHook): to enable "
            f"the plugin, {MODEL_RESOURCE_EDIT}"
        )
    verdict = (
        "FAIL: " + problems[0].splitlines()[0]
        if problems
        else "PASS: each packed document gets the logits, loss and gradients it gets alone; "
        "generation unchanged"
    )
    return {
        "figures": fig,
        "problems": problems,
        "verdict": verdict,
        "exit_code": 1 if problems else 0,
    }


def format_summary(report: dict) -> str:
    """The short text printed by ``xtuner-rope check``."""
    if report.get("kind") == "preference":
        from xtuner_rope.doctor.check_preference import format_preference_summary

        return format_preference_summary(report)
    if report.get("kind") == "llava":
        from xtuner_rope.doctor.llava_check import format_llava_summary

        return format_llava_summary(report)
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


def write_report(report: dict, out: str | Path) -> Path:
    """``report.json`` in ``out`` (created); returns its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return path
