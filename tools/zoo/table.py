"""The sweep's results as markdown: one row per config with the counts of each outcome, and
the classes of the zoo with the rows that cover them."""

from __future__ import annotations

from tools.zoo.classes import coverage, zoo_classes
from tools.zoo.judge import OUTCOMES, doctor_agrees


def counts(results: dict) -> dict:
    """Rows per outcome, and the doctor's verdicts judged with their reasons
    (:func:`doctor_agrees`: right, wrong, not comparable)."""
    out = {k: sum(1 for r in results.values() if r["outcome"] == k) for k in OUTCOMES}
    verdicts = [doctor_agrees(r) for r in results.values()]
    out["doctor right"] = sum(1 for v in verdicts if v is True)
    out["doctor wrong"] = sum(1 for v in verdicts if v is False)
    return out


def markdown(results: dict) -> str:
    """The results as a markdown table (one row per config, sorted), with the counts."""
    lines = [
        "| config | family | mode | outcome | detail | doctor | doctor = outcome |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(results):
        r = results[name]
        mode = r.get("mode") or {}
        mode_s = "/".join(str(mode[k]) for k in ("kind", "tuning", "packing") if k in mode)
        doctor = r.get("doctor") or {}
        pred = {True: "yes", False: "**no**", None: "n/a"}[doctor_agrees(r)]
        detail = str(r.get("message", "")).replace("|", "\\|").replace("\n", " ")[:160]
        said = "; ".join(doctor.get("reasons") or [])
        said = f": {said}".replace("|", "\\|").replace("\n", " ")[:120] if said else ""
        lines.append(
            f"| {name} | {r.get('family')} | {mode_s} | {r['outcome']} | {detail} | "
            f"exit {doctor.get('exit_code', '-')}{said} | {pred} |"
        )
    c = counts(results)
    lines += [
        "",
        "Counts: " + ", ".join(f"{k} {v}" for k, v in c.items()) + f" (of {len(results)} configs).",
    ]
    return "\n".join(lines) + "\n"


def classes_markdown(texts: dict[str, str], results: dict) -> tuple[str, list[str]]:
    """The classes table (axis, class, configs, covering rows and their outcomes) and its
    closing line; also the uncovered classes (``axis: class``).

    Args:
        texts: ``{config: text}`` of the configs to classify (all 594 stock ones).
        results: The sweep's rows.
    """
    lines = [
        "| axis | class | configs | swept rows covering it | outcome |",
        "|---|---|---|---|---|",
    ]
    uncovered = []
    table = coverage(zoo_classes(texts), results)
    for axis, value, n, good, other in table:
        shown = good[:3] + [f"(+{len(good) - 3})"] if len(good) > 3 else good
        outcomes = sorted({results[r]["outcome"] for r in good})
        if not good:
            uncovered.append(f"{axis}: {value}")
            tried = f" (swept, not covering: {', '.join(other[:2])})" if other else ""
            shown, outcomes = [f"**none**{tried}"], ["uncovered"]
        lines.append(f"| {axis} | {value} | {n} | {', '.join(shown)} | {', '.join(outcomes)} |")
    swept = sum(1 for name in texts if name in results)
    lines += [
        "",
        f"{len(texts)} configs ({swept} swept), {len(table)} classes, {len(uncovered)} uncovered.",
    ]
    return "\n".join(lines) + "\n", uncovered
