"""The doctor on XTuner's cuts at ``max_length`` and at row edges: summary line and warnings."""

from __future__ import annotations

from xtuner_rope.data.reference_truncation import reference_warning, sequences_note
from xtuner_rope.data.truncation import STEP, truncation_message, unit
from xtuner_rope.doctor.stats import Occurrences


def truncated_occurrences(figures: dict) -> Occurrences:
    """``samples.truncated`` from the exact count (indices in tokenized order, before packing)."""
    return Occurrences(figures["truncated"], list(figures["first_truncated"]))


def truncation_lines(figures: dict | None) -> list[str]:
    """The summary's ``truncation`` line (none without figures)."""
    if not figures:
        return []
    t, lab, what = figures["tokens"], figures["labels"], unit(figures)
    ref = figures.get("reference")
    if ref:  # is_reference pairs: responses and prompts cut, the text encoded again
        p = ref["prompt_tokens"]
        left = (
            f"{figures['responses']} responses cut at max_response_length="
            f"{ref['max_response_length']}, {ref['prompts']} prompts shortened (lost "
            f"{p['lost']} of {p['before']} prompt tokens), {ref['no_room']} prompts left no room"
        )
    elif "responses" in figures:
        left = (
            f"{figures['responses']} responses cut, {figures['unsupervised']} pairs left with a "
            "response without a label"
        )
    else:
        left = f"{figures['dropped']} dropped with no label left"
    lines = [
        f"truncation   {figures['truncated']} of {figures['dialogues']} {what} truncated at "
        f"max_length={figures['max_length']} by {figures.get('step', STEP)} ({left}): tokens {t['before']} -> {t['after']} (lost {t['lost']}), "
        f"supervised labels {lab['before']} -> {lab['after']} (lost {lab['lost']}); longest "
        f"{figures['keep_all']}, 99% <= {figures['keep_99']}"
    ]
    if ref:
        lines.append(f"             {sequences_note(figures)}")
    return lines


def truncation_warnings(figures: dict | None) -> list[str]:
    """A warning when XTuner's cut loses tokens, with the ``max_length`` that would keep them."""
    room = reference_warning(figures)  # is_reference pairs whose prompt XTuner keeps whole
    message = truncation_message(figures)
    if message is None:
        return [room] if room else []
    edit = (
        f"set max_length = {figures['keep_all']} (every {unit(figures, False)} whole) or "
        f"{figures['keep_99']} (99%)"
    )
    if figures.get("reference"):
        edit += (
            f" with max_response_length = {figures['reference']['keep_response_length']} "
            "(every response whole)"
        )
    if figures["pretraining"]:
        edit += (
            ', or with xtuner-rope enabled leave offline_packing = "whole" (the default): '
            "pretraining documents are split into max_length pieces, not cut"
        )
    return [f"{message}\n  -> {edit}"] + ([room] if room else [])


def data_unit(report: dict, plural: bool = True) -> str:
    """What the data's rows are: pretraining ``documents`` or ``dialogues``."""
    if report.get("truncation"):
        return unit(report["truncation"], plural)
    packing = report.get("packing") or {}
    word = "document" if packing and not packing.get("sft", True) else "dialogue"
    return word + ("s" if plural else "")


def cut_warnings(report: dict) -> list[str]:
    """A warning when rows hold pieces of the data cut at row edges (the cut opt-out)."""
    packing = report.get("packing") or {}
    if not packing.get("cut_dialogues"):
        return []
    what, one = data_unit(report), data_unit(report, False)
    why = (
        "a piece after the first starts at position 0 without the text before it"
        if what == "documents"
        else "a piece starts mid-dialogue at position 0, without its prompt"
    )
    return [
        f"{packing['cut_dialogues']} of {packing['dialogues']} {what} are cut at row edges and "
        f"trained as {packing['pieces']} pieces ({why}), {packing['unsupervised_pieces']} of "
        f'them without a supervised label; offline_packing = "whole" (the default with '
        f"xtuner-rope) packs each {one} whole"
    ]


def cut_verdict(report: dict) -> str | None:
    """The summary's last line for the cut opt-out (exit 0), naming any ``max_length`` cut; or
    None."""
    packing = report.get("packing") or {}
    if not packing.get("cut_dialogues"):
        return None
    cut = report.get("truncation")
    truncated = (
        f" and {cut['truncated']} of {cut['dialogues']} lose their ends at "
        f"max_length={cut['max_length']}"
        if truncation_message(cut)
        else ""
    )
    return (
        f"CUT: {packing['cut_dialogues']} of {packing['dialogues']} {data_unit(report)} are "
        f"trained as pieces{truncated}, as this config asks (see the "
        f"warning{'s' if truncated else ''}); nothing else would fail or corrupt training "
        "(exit 0)"
    )
