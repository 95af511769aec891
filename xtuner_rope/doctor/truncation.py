"""The doctor on XTuner's cut at ``max_length``: counted exactly, before any packing.

``process_hf_dataset`` builds the doctor's data inside ``data.truncation.counting_truncation``
(packed offline or not): its tokenize step runs uncut, is counted, then cut as XTuner cuts. The
report's ``truncation`` holds those figures (None where no ``process_hf_dataset`` built the data:
the intern-repo loaders, tokenized data, the heuristic ``samples.truncated`` stays there); this
module turns them into the samples' ``truncated`` entry, the summary line and the warning, in the
words of the start-up's own line (``data.truncation.truncation_message``).
"""

from __future__ import annotations

from xtuner_rope.data.truncation import truncation_message, unit
from xtuner_rope.doctor.stats import Occurrences


def truncated_occurrences(figures: dict) -> Occurrences:
    """``samples.truncated`` from the exact count (indices: the dialogues XTuner keeps, in
    tokenized order; before any shuffle and packing)."""
    return Occurrences(figures["truncated"], list(figures["first_truncated"]))


def truncation_lines(figures: dict | None) -> list[str]:
    """The summary's ``truncation`` line (none without figures)."""
    if not figures:
        return []
    t, lab, what = figures["tokens"], figures["labels"], unit(figures)
    split = (
        f"; {figures['split']} documents longer than max_length split into max_length pieces "
        "instead (every token trained once)"
        if figures["split"]
        else ""
    )
    return [
        f"truncation   {figures['truncated']} of {figures['dialogues']} {what} truncated at "
        f"max_length={figures['max_length']} by XTuner's encode_fn ({figures['dropped']} "
        f"dropped with no label left): tokens {t['before']} -> {t['after']} (lost {t['lost']}), "
        f"supervised labels {lab['before']} -> {lab['after']} (lost {lab['lost']}); longest "
        f"{figures['keep_all']}, 99% <= {figures['keep_99']}{split}"
    ]


def truncation_warnings(figures: dict | None) -> list[str]:
    """A warning when XTuner's cut loses tokens, with the ``max_length`` that would keep them."""
    message = truncation_message(figures)
    if message is None:
        return []
    edit = (
        f"set max_length = {figures['keep_all']} (every {unit(figures, False)} whole) or "
        f"{figures['keep_99']} (99%)"
    )
    if figures["pretraining"]:
        edit += (
            ', or with xtuner-rope enabled leave offline_packing = "whole" (the default): '
            "pretraining documents are split into max_length pieces, not cut"
        )
    return [f"{message}\n  -> {edit}"]
