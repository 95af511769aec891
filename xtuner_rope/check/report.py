"""Tolerances, verdict, the report's head and ``report.json`` of ``xtuner-rope check``.

Tolerances are relative to ``max(1, |reference|)``: packed and alone differ by rounding only.
fp32: 1e-5 (logits, loss), 1e-4 (gradients); bf16/fp16: 8 units in the last place (the patch
rotates q/k in fp32, the reference in the activation dtype). A leak moves logits by whole units.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmengine.config import Config

from xtuner_rope.capture.measure import BOUNDARY_HOOKS
from xtuner_rope.check.chunked_loss import chunked_loss_problems
from xtuner_rope.config.findings import MODEL_RESOURCE_EDIT
from xtuner_rope.doctor.diagnose import plugin_resource

TOLERANCES = {  # relative, see the module docstring
    "float32": {"logits": 1e-5, "loss": 1e-5, "grads": 1e-4},
    "bfloat16": {"logits": 8 * 2**-8, "loss": 8 * 2**-8, "grads": 8 * 2**-8},
    "float16": {"logits": 8 * 2**-11, "loss": 8 * 2**-11, "grads": 8 * 2**-11},
}


def figures(report: dict) -> dict:
    """The headline differences, each ``diff / scale`` next to its tolerance."""
    tol = TOLERANCES[report["model"]["dtype"]]
    docs = [dict(d, batch=i) for i, b in enumerate(report["batches"]) for d in b["logits"]]
    worst = max(docs, key=lambda d: d["max_abs_diff"] / max(1.0, d["max_abs_logit"]))
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
    problems += chunked_loss_problems(report.get("chunked_loss"))
    compared = (report.get("chunked_loss") or {}).get("compared")
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
        + ("; the chunked loss equals the full-logits loss" if compared else "")
    )
    return {
        "figures": fig,
        "problems": problems,
        "verdict": verdict,
        "exit_code": 1 if problems else 0,
    }


def report_head(
    cfg: Config, request, prepared, measured: dict, model_class: str, size: int
) -> dict:
    """The report's config, plugin and model entries (pops ``patched`` and ``backend``).

    Shared by the text and LLaVA checks: what was checked (``request``: the ``CheckRequest``;
    ``prepared``: the ``PreparedRunner``), with the attention the language model really ran
    (the layers' classes, the packed backend); ``size``: the model's parameters.
    """
    llm, hooks = prepared.runner.model.llm, prepared.hooks
    return {
        "config": str(request.config),
        "cfg_options": {k: str(v) for k, v in (request.cfg_options or {}).items()},
        "plugin": {
            "model_resource": plugin_resource(cfg),
            "patched": measured.pop("patched"),
            "hooks": [n for n in ("ValidatedRoPEHook", *BOUNDARY_HOOKS) if n in hooks],
        },
        "model": {
            "class": model_class,
            "path": str(getattr(llm, "name_or_path", "")),
            "device": str(prepared.device),
            "dtype": str(prepared.dtype).replace("torch.", ""),
            # What picks the layers' class: InternLM2's own config attribute, else HF's.
            "attn_implementation": getattr(llm.config, "attn_implementation", None)
            or getattr(llm.config, "_attn_implementation", None),
            "packed_backend": measured.pop("backend"),
            "attention_layers": sorted(
                {
                    type(m).__name__
                    for m in llm.modules()
                    if type(m).__name__.endswith(("Attention", "Attention2"))
                }
            ),
            "parameters": size,
        },
    }


def write_report(report: dict, out: str | Path) -> Path:
    """``report.json`` in ``out`` (created); returns its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return path
