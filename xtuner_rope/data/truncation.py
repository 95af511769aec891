"""What XTuner's ``encode_fn`` cuts at ``max_length``, counted; pretraining text kept whole.

XTuner's tokenize step runs uncut, is counted, then cut exactly as XTuner cuts; with
``split_documents=True`` pretraining documents stay whole for the pack step to split.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys

import numpy as np
import pyarrow.compute as pc

from .cut_counts import FIRST_INDICES, kept_counts, length_quantile
from .reference_truncation import reference_message

IGNORE_INDEX = -100
STEP = "XTuner's encode_fn"  # what cuts (the figures' ``step`` where another does)


def _cut(batch: dict, max_length: int, keep_from: int | None) -> dict:
    """``encode_fn``'s cut of a batch; rows supervised from ``keep_from`` on (pretraining) kept
    whole."""
    ids, labels = [], []
    for row_ids, row_labels in zip(batch["input_ids"], batch["labels"]):
        whole = keep_from is not None and IGNORE_INDEX not in row_labels[keep_from:]
        ids.append(row_ids if whole else row_ids[:max_length])
        labels.append(row_labels if whole else row_labels[:max_length])
    return {"input_ids": ids, "labels": labels}


def _row_sums(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``[n]`` counts of ``mask`` over each row's span ``[starts, ends)`` of the flat stream."""
    cumulative = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    return cumulative[ends] - cumulative[starts]


def truncation_figures(table, max_length: int, bos: int, split_documents: bool) -> dict:
    """What cutting each row of an uncut tokenized ``table`` at ``max_length`` loses, JSON-ready
    (rows without a supervised label left out, as XTuner drops them).

    Args:
        bos: The tokenizer's BOS tokens per turn (labels -100 in pretraining text).
        split_documents: Pretraining documents are kept whole (split by the pack step).

    Returns:
        ``dialogues``, ``documents``, ``pretraining``, ``truncated``, ``dropped``, ``split``,
        ``tokens`` / ``labels`` (``before`` / ``after`` / ``lost``), ``keep_all`` / ``keep_99``,
        ``first_truncated``, ``max_length``.
    """
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    lengths = lengths.astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    flat_labels = pc.list_flatten(table.column("labels")).to_numpy(zero_copy_only=False)
    supervised = flat_labels != IGNORE_INDEX
    labels_before = _row_sums(supervised, starts, ends)
    ignored_bos = np.zeros(len(lengths), dtype=np.int64)  # -100 labels among the BOS tokens
    for k in range(bos):  # 0 to 2 tokens: no per-token position array
        has = lengths > k
        ignored_bos[has] += ~supervised[starts[has] + k]
    document = (lengths - labels_before == ignored_bos) & (labels_before > 0)
    kept = labels_before > 0  # XTuner's filter of the uncut rows
    long = kept & (lengths > max_length)
    whole = document & split_documents
    cut = long & ~whole
    after = np.where(cut, max_length, lengths)
    labels_after = _row_sums(supervised, starts, starts + after)
    dropped = cut & (labels_after == 0)
    survivors = kept & ~dropped
    order = np.cumsum(survivors) - 1  # index among the rows XTuner keeps
    sorted_lengths = np.sort(lengths[kept])
    n = len(sorted_lengths)
    return {
        "max_length": int(max_length),
        "dialogues": int(n),
        "documents": int(document.sum()),
        "pretraining": bool(n and document[kept].all()),
        "truncated": int(cut.sum()),
        "dropped": int(dropped.sum()),
        "split": int((long & whole).sum()),
        "tokens": kept_counts(lengths[kept].sum(), after[survivors].sum()),
        "labels": kept_counts(labels_before[kept].sum(), labels_after[survivors].sum()),
        "keep_all": int(sorted_lengths[-1]) if n else None,
        "keep_99": length_quantile(sorted_lengths, 0.99),
        "first_truncated": [int(i) for i in order[cut & ~dropped][:FIRST_INDICES]],
    }


SUMMED = ("dialogues", "documents", "truncated", "dropped", "split")


def summed_figures(parts: list[dict]) -> dict | None:
    """Several tokenize calls' figures as one (a config of several datasets); None for none."""
    if not parts:
        return None
    total = dict(parts[-1])
    for key in SUMMED:
        total[key] = sum(p[key] for p in parts)
    for key in ("tokens", "labels"):
        total[key] = {k: sum(p[key][k] for p in parts) for k in ("before", "after", "lost")}
    for key in ("keep_all", "keep_99"):
        values = [p[key] for p in parts if p[key] is not None]
        total[key] = max(values) if values else None
    total["pretraining"] = all(p["pretraining"] for p in parts)
    total["first_truncated"] = parts[0]["first_truncated"] if len(parts) == 1 else []
    return total


_SINKS: list[list] = []  # the open counting_truncation contexts' figure lists, outermost first
_SPLIT: list[bool] = []


@contextlib.contextmanager
def _counting_block(split: bool):
    """Open one counting block (its figures list, its ``split_documents``) for this block."""
    sink: list = []
    _SINKS.append(sink)
    _SPLIT.append(split)
    try:
        yield sink
    finally:
        _SINKS.pop()
        _SPLIT.pop()


def _tokenize(
    original,
    dataset,
    tokenizer,
    max_length,
    with_image_token,
    input_ids_with_output,
    remove_unused_columns,
    map_num_proc,
):
    """XTuner's ``tokenize_dataset`` (same arguments), uncut, counted, then cut as XTuner cuts."""
    from mmengine.config import Config, ConfigDict
    from xtuner.dataset.utils import get_bos_eos_token_ids
    from xtuner.registry import BUILDER

    if isinstance(tokenizer, (dict, Config, ConfigDict)):
        tokenizer = BUILDER.build(tokenizer)
    full = original(
        dataset,
        tokenizer,
        sys.maxsize,  # encode_fn cuts at len(input_ids) > max_length: never
        with_image_token,
        input_ids_with_output,
        remove_unused_columns,
        map_num_proc,
    )
    bos = len(get_bos_eos_token_ids(tokenizer)[0])
    split = bool(_SPLIT and _SPLIT[-1])
    figures = truncation_figures(full.with_format("arrow")[:], max_length, bos, split)
    record_figures(figures)
    longest = pc.max(pc.list_value_length(full.data.column("input_ids"))).as_py() or 0
    if longest <= max_length:  # nothing for encode_fn to cut
        return full
    cut = functools.partial(_cut, max_length=max_length, keep_from=bos if split else None)
    return full.map(cut, batched=True, num_proc=map_num_proc)


def record_figures(figures: dict) -> bool:
    """Give ``figures`` to every open :func:`counting_truncation` block; False when none is open."""
    for sink in _SINKS:
        sink.append(figures)
    return bool(_SINKS)


def counted_tokenize_step(original):
    """XTuner's ``tokenize_dataset`` (``original``), counted and logged wherever no counting block
    is open."""

    @functools.wraps(original)
    def counted(dataset, tokenizer, max_length, *args, **kwargs):
        step = functools.partial(original, dataset, tokenizer, max_length, *args, **kwargs)
        with_output = kwargs.get("input_ids_with_output", args[1] if len(args) > 1 else True)
        if _SINKS or not with_output or not isinstance(max_length, int):
            return step()  # counted by the open block; or nothing cut to count
        with _counting_block(split=False) as sink:
            built = _tokenize(original, dataset, tokenizer, max_length, *args, **kwargs)
        from mmengine.logging import print_log

        (figures,) = sink
        level = logging.WARNING if truncation_message(figures) else logging.INFO
        print_log(tokenized_line(figures), logger="current", level=level)
        return built

    counted._xtuner_rope_counted = True
    return counted


def tokenized_line(figures: dict) -> str:
    """The start-up's line on one tokenize step that no packing line reports (unpacked data)."""
    t, lab = figures["tokens"], figures["labels"]
    head = (
        f"xtuner-rope: XTuner's {figures.get('builder', 'process_hf_dataset')} tokenized "
        f"{figures['dialogues']} "
        f"{unit(figures)} ({t['before']} tokens, {lab['before']} supervised labels) at "
        f"max_length={figures['max_length']}"
    )
    message = truncation_message(figures)
    return f"{head}, none truncated." if message is None else f"{head}. {message}."


@contextlib.contextmanager
def counting_truncation(split_documents: bool = False):
    """Count what ``encode_fn`` cuts in this block: yields a list that gets one
    :func:`truncation_figures` dict per tokenize step (``split_documents``: keep pretraining
    documents whole; the innermost block decides)."""
    from xtuner_rope.compat.xtuner_tokenize import xtuner_tokenize_step

    with _counting_block(split_documents) as sink:
        if len(_SINKS) > 1:  # an outer block has XTuner's step swapped already
            yield sink
        else:
            with xtuner_tokenize_step(lambda original: functools.partial(_tokenize, original)):
                yield sink


def unit(figures: dict | None, plural: bool = True) -> str:
    """What the rows are: the figures' ``unit`` (``pairs``), else ``documents`` or ``dialogues``."""
    word = (figures or {}).get("unit") or (
        "document" if figures and figures["pretraining"] else "dialogue"
    )
    return word + ("s" if plural else "")


def truncation_message(figures: dict | None) -> str | None:
    """The one sentence on what ``encode_fn``'s cut loses, or None when it cuts nothing."""
    if not figures or not figures["truncated"]:
        return None
    if figures.get("reference"):  # is_reference pairs: cut at two settings, not one
        return reference_message(figures)
    t, lab, what = figures["tokens"], figures["labels"], unit(figures)
    dropped = (
        f" ({figures['dropped']} of them dropped: no supervised label left)"
        if figures["dropped"]
        else ""
    )
    if figures.get("unsupervised"):
        dropped += (
            f" ({figures['unsupervised']} of them left with a response without a supervised label)"
        )
    return (
        f"{figures.get('step', STEP)} truncates {figures['truncated']} of {figures['dialogues']} {what} "
        f"at max_length={figures['max_length']}{dropped}: {t['lost']} of {t['before']} tokens "
        f"and {lab['lost']} of {lab['before']} supervised labels are never trained; "
        f"max_length = {figures['keep_all']} keeps every {unit(figures, False)} whole, "
        f"{figures['keep_99']} keeps 99% of them"
    )
