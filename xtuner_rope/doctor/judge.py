"""The doctor's judgement of its report: problems that fail training, warnings, the exit code."""

from __future__ import annotations

from xtuner_rope.config.findings import MODEL_RESOURCE_EDIT
from xtuner_rope.doctor.truncation import cut_warnings, truncation_warnings

__all__ = ["exit_code", "judge"]


def _where(occ: dict, what: str = "samples") -> str:
    more = "" if occ["count"] <= len(occ["first_indices"]) else ", ..."
    return f"{occ['count']} {what} (first: {', '.join(map(str, occ['first_indices']))}{more})"


def judge(report: dict) -> tuple[list[str], list[str]]:
    """Problems (training fails or is silently wrong: start-up conflicts; packed data without the
    plugin; empty, over-long or label-mismatched samples; unsupervised sampler batches; refused
    batches) and warnings (the rest) of a report."""
    problems = [
        f"conflict: {c['setting']}: {c['problem']}\n  -> {c['edit']}"
        for c in report["findings"]["conflicts"]
    ]
    warnings = []
    if not report["plugin"]["enabled"]:
        unfixed = "".join(
            f"\n  unfixed: {f['setting']}: {f['problem']}" for f in report["findings"]["fixes"]
        )
        text = (
            f"xtuner-rope is not enabled (no model_resource from xtuner_rope): its start-up "
            f"fixes do not run. To enable it, {MODEL_RESOURCE_EDIT}{unfixed}"
        )
        (problems if report["packed"] else warnings).append(
            text
            + (
                "\n  the data are packed: documents would attend to each other"
                if report["packed"]
                else ""
            )
        )
    samples, collate = report["samples"], report["collate"]
    why = {
        "empty": "empty samples (0 tokens)",
        "over_long": f"samples longer than the collate max_length={collate['max_length']}",
        "length_mismatch": "samples with len(labels) != len(input_ids)",
    }
    problems += [f"{why[k]}: {_where(samples[k])}" for k in why if samples[k]["count"]]
    if collate["unsupervised_batches"]["count"]:
        problems.append(
            "sampler batches without any supervised label (nothing to train on): "
            + _where(collate["unsupervised_batches"], "batches")
        )
    problems += [
        f"collate_fn refuses batch {e['batch']} (samples from {e['first_sample']}): {e['error']}"
        for e in collate["errors"][:10]
    ]
    if samples["unsupervised"]["count"]:
        warnings.append(
            "samples without a supervised label (they add no loss): "
            + _where(samples["unsupervised"])
        )
    warnings += truncation_warnings(report.get("truncation"))
    if samples["truncated"]["count"] and not report.get("truncation"):
        warnings.append(
            f"samples exactly max_length={report['dataset']['max_length']} long, "
            "probably cut silently by XTuner: " + _where(samples["truncated"])
        )
    dropped = report["dataset"]["dropped_by_dataset"]
    if dropped:
        cut = (report.get("truncation") or {}).get("dropped")
        why = (
            "no assistant reply, or no label left after truncation"
            if cut is None
            else f"{dropped - cut} without a supervised label, {cut} left without one by the "
            "truncation at max_length"
        )
        warnings.append(
            f"{dropped} of {report['dataset']['source_rows']} source rows were dropped by "
            f"XTuner ({why})"
        )
    packing = report["packing"] or {}
    if packing.get("tokens", {}).get("lost"):
        t, lab = packing["tokens"], packing["labels"]
        where = (
            'the last partial row of each file; offline_packing = "whole" (the default with '
            "xtuner-rope) drops nothing"
            if packing["packer"] == "intern_repo"
            else "each map_num_proc shard's leftover; with xtuner-rope enabled nothing is dropped"
        )
        warnings.append(
            f"XTuner's offline packing drops {t['lost']} of {t['before']} tokens and "
            f"{lab['lost']} of {lab['before']} supervised labels ({where})"
        )
    warnings += cut_warnings(report)
    warnings += collate["collate_warnings"]
    return problems, warnings


def exit_code(report: dict) -> int:
    """1 when the report has a problem (training would fail or be silently wrong), else 0."""
    return 1 if report["problems"] else 0
