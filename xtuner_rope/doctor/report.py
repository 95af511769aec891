"""The doctor's output: ``report.json``, ``lengths.png`` and the printed summary.

Reads the report dict of :func:`xtuner_rope.doctor.diagnose`; computes nothing itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from xtuner_rope.data.truncation import truncation_message, unit
from xtuner_rope.doctor.checkpoint_space import checkpoint_space_lines, fits
from xtuner_rope.doctor.heldout import heldout_lines
from xtuner_rope.doctor.internvl_stats import internvl_lines
from xtuner_rope.doctor.llava_stats import llava_lines
from xtuner_rope.doctor.logits_memory import logits_memory_lines
from xtuner_rope.doctor.loss_weights import loss_weight_line
from xtuner_rope.doctor.preference import preference_lines
from xtuner_rope.doctor.rope import rope_lines
from xtuner_rope.doctor.sequence_parallel import sequence_parallel_lines
from xtuner_rope.doctor.stats import percentiles_text
from xtuner_rope.doctor.truncation import cut_verdict, data_unit, truncation_lines


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


def _occ(occ: dict) -> str:
    if not occ["count"]:
        return "0"
    more = ", ..." if occ["count"] > len(occ["first_indices"]) else ""
    return f"{occ['count']} (first: {', '.join(map(str, occ['first_indices']))}{more})"


def _data_lines(report: dict) -> list[str]:
    ds, lengths, samples = report["dataset"], report["lengths"], report["samples"]
    source = (
        ""
        if ds["source_rows"] is None
        else f" (from {ds['source_rows']} source rows, {ds['dropped_by_dataset']} dropped by XTuner)"
    )
    how = (
        f"rows packed offline to {ds['max_length']} tokens (packed_length)"
        if ds.get("packed_offline")
        else f"max_length={ds['max_length']}, pack_to_max_length={ds['pack_to_max_length']}"
    )
    return [
        f"dataset      {ds['type']}: {ds['samples']} samples{source}, {ds['documents']} "
        f"documents, {ds['tokens']} tokens; {how}",
        "lengths      "
        + (f"{data_unit(report)} before packing: " if report["packing"] else "")
        + percentiles_text(lengths),
        "samples      " + "  ".join(f"{k}={_occ(v)}" for k, v in samples.items()),
        *truncation_lines(report.get("truncation")),
    ] + _packing_lines(report, report["collate"]["batch_size"])


def _kept(packed: dict, cut: dict | None) -> str:
    """``before -> after (lost n)`` from the data to the rows: XTuner's cut, then packing."""
    if not cut or not cut["lost"]:
        return f"{packed['before']} -> {packed['after']} (lost {packed['lost']})"
    return (
        f"{cut['before']} -> {packed['after']} (lost {cut['lost'] + packed['lost']}: "
        f"{cut['lost']} truncated, {packed['lost']} by packing)"
    )


def _packing_lines(report: dict, batch_size: int) -> list[str]:
    p, cut = report["packing"], report.get("truncation")
    if not p:
        return []
    t, lab, xt, what = p["tokens"], p["labels"], p["xtuner_cut"], data_unit(report)
    lines = [
        f"packing      {p['dialogues']} {what} -> {p['rows']} rows of max_length="
        f"{p['max_length']}: tokens {_kept(t, cut and cut['tokens'])}, "
        f"supervised labels {_kept(lab, cut and cut['labels'])}",
        f"             row lengths {percentiles_text(p['row_lengths'])}, fill {p['fill']:.1%} "
        "(tokens / row slots)",
        f"             epoch: {p['rows']} rows, {-(-p['rows'] // batch_size)} iterations of "
        f"batch size {batch_size}; XTuner's cut of the same stream: {xt['rows']} rows, "
        f"{-(-xt['rows'] // batch_size)} iterations, {xt['cut_dialogues']} {what} cut",
    ]
    if p["cut_dialogues"] is not None:
        lines.append(
            f"             {p['cut_dialogues']} {what} cut at row edges "
            f"({p['pieces']} pieces, {p['unsupervised_pieces']} with no supervised "
            f"label); unsupervised_seen after one epoch: {p['unsupervised_seen']}"
        )
    seed = p.get("shuffle_seed")
    if seed and seed["drawn"]:
        lines.append(
            f"             randomness.seed is None: the figures that depend on the shuffle "
            f"before packing (rows, pieces, unsupervised_seen) used seed {seed['used']}; "
            f"training draws another (set randomness = dict(seed={seed['used']}) to train "
            "on these rows)"
        )
    if p.get("split_long"):
        into = "" if p.get("split_pieces") is None else f"{p['split_pieces']} "
        lines.append(
            f"             {p['split_long']} documents longer than max_length={p['max_length']} "
            f"split into {into}max_length pieces (no row holds them whole)"
        )
    return lines


def _collate_lines(report: dict) -> list[str]:
    c = report["collate"]
    kwargs = ", ".join(f"{k}={v}" for k, v in c["kwargs"].items())
    rows = c["rows_per_step"]
    speedup = "n/a" if c["ideal_speedup"] is None else f"{c['ideal_speedup']:.2f}x"
    return [
        f"collate      {c['name']}({kwargs}), batch_size={c['batch_size']}: first "
        f"{c['batches']} of {c['batches_total']} batches, {c['order']}",
        f"             rows per step mean {rows['mean'] if rows['mean'] is None else round(rows['mean'], 2)}"
        f" (min {rows['min']}, max {rows['max']}); real tokens {_pct(c['config_share'])} "
        f"with {c['name']}, {_pct(c['padded_share'])} padded to each batch's longest "
        "(XTuner default_collate_fn)",
        f"             ideal speed-up from padding alone: {speedup} "
        f"({c['padded_slots']} -> {c['config_slots']} token slots)",
        f"             batches with no supervised label: {_occ(c['unsupervised_batches'])}; "
        f"refused by the collate function: {len(c['errors'])}",
    ]


def format_summary(report: dict) -> str:
    """The human summary the CLI prints."""
    plugin = report["plugin"]
    findings = report["findings"]
    lines = [
        f"xtuner-rope doctor: {report['config']}",
        "plugin       "
        + (
            f"enabled ({plugin['model_resource']})"
            if plugin["enabled"]
            else "NOT enabled (no model_resource from xtuner_rope)"
        ),
    ]
    lines += [f"start-up fix {f['setting']}: {f['edit']}" for f in findings["fixes"]]
    lines += preference_lines(report) if report.get("preference") else _data_lines(report)
    lines += llava_lines(report.get("multimodal"))
    lines += internvl_lines(report.get("internvl"))
    lines += _collate_lines(report)
    lines += heldout_lines(report.get("heldout"))
    lines += loss_weight_line(report.get("loss_weights"))
    lines += sequence_parallel_lines(report.get("sequence_parallel"))
    lines += rope_lines(report.get("rope"))
    lines += logits_memory_lines(report.get("logits"))
    lines += checkpoint_space_lines(report.get("checkpoints"))
    lines += [f"PROBLEM      {p}" for p in report["problems"]]
    lines += [f"warning      {w}" for w in report["warnings"]]
    if report["exit_code"]:
        verdict = "FAIL: training would fail or be silently wrong (exit 1)"
    elif cut_verdict(report):  # offline_packing = "cut"
        verdict = cut_verdict(report)
    elif truncation_message(report.get("truncation")):
        cut = report["truncation"]
        where = f"max_length={cut['max_length']}"
        if cut.get("reference"):  # tokenize_ref: responses at their end, prompts at their start
            where += f", max_response_length={cut['reference']['max_response_length']}"
        verdict = (
            f"TRUNCATED: {cut['truncated']} of {cut['dialogues']} {unit(cut)} lose "
            f"{'tokens' if cut.get('reference') else 'their ends'} at {where} (see the "
            "warning); nothing else would fail or corrupt training (exit 0)"
        )
    elif fits(report.get("checkpoints")) is False:
        verdict = (
            "DISK: the checkpoints the run keeps do not fit in the free space (see the "
            "warning); nothing else would fail or corrupt training (exit 0)"
        )
    else:
        verdict = "OK: nothing that would fail or corrupt training (exit 0)"
    return "\n".join(lines + [verdict])


def plot_lengths(
    lengths: Sequence[int], max_length: int | None, path: Path, title: str, unit: str = "sample"
) -> None:
    """Histogram of sample lengths, ``max_length`` marked, as a PNG (Agg backend, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.hist(lengths, bins=min(60, max(1, len(np.unique(lengths)))), color="#4878a8")
    if max_length:
        ax.axvline(max_length, color="#c0392b", linestyle="--", label=f"max_length={max_length}")
        ax.legend()
    ax.set_xlabel(f"tokens per {unit}")
    ax.set_ylabel(f"{unit}s")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)


def write_outputs(report: dict, lengths: Sequence[int], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json`` and ``lengths.png`` into ``out_dir`` (created); their paths by
    ``'report'`` and ``'lengths'``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report": out / "report.json", "lengths": out / "lengths.png"}
    paths["report"].write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    max_length = report["collate"]["max_length"] or report["dataset"]["max_length"]
    unit = "dialogue" if report["packing"] else "sample"  # offline packing: before packing
    plot_lengths(
        lengths,
        max_length,
        paths["lengths"],
        f"{Path(report['config']).stem}: {len(lengths)} {unit}s",
        unit,
    )
    return paths
