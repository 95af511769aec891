"""The doctor on XTuner's offline packing: the dialogues before packing and what packing did."""

from __future__ import annotations

import copy

import numpy as np

from xtuner_rope.data.cut_counts import kept_counts
from xtuner_rope.data.pack_plans import cut_dialogues, cut_plan, intern_repo_cut_plan
from xtuner_rope.data.truncation import counting_truncation, summed_figures
from xtuner_rope.doctor.packing_passes import dialogue_pass, packed_pass, segment_starts
from xtuner_rope.doctor.progress import QUIET, Progress
from xtuner_rope.doctor.token_columns import row_lengths, whole_matches


def build_dialogues_and_packs(dataset_cfg: dict, seed: int | None, progress: Progress = QUIET):
    """The dialogues in stream order and the packed dataset, as the config's ``dataset_cfg`` builds
    them (the plugin's pack step recorded; XTuner's run on the unpacked dialogues, shuffled as
    XTuner shuffles them, numpy seeded with ``seed``).

    Returns:
        ``(dialogues, packed, truncation, seed)``: what ``encode_fn`` cut is
        ``truncation_figures``; the seed is drawn when ``seed`` is None.
    """
    from mmengine.runner import set_random_seed
    from xtuner.registry import BUILDER

    from xtuner_rope.config.fields import type_name
    from xtuner_rope.data.packed_dataset import recorded_packs

    used = set_random_seed(seed)  # None: a seed drawn as MMEngine's Runner draws one
    if type_name(dataset_cfg.get("type")) != "lossless_process_hf_dataset":
        return (*_xtuner_dialogues_and_packs(dataset_cfg), used)
    whole = dataset_cfg.get("whole_dialogues", True)
    progress.stage("building the train dataset as xtuner train builds it")
    with counting_truncation(split_documents=whole) as truncation, recorded_packs() as packs:
        built = BUILDER.build(dataset_cfg)
    dialogues, _ = packs[-1]
    return dialogues, built, summed_figures(truncation), used


def _xtuner_dialogues_and_packs(dataset_cfg: dict):
    """``(dialogues, packed, truncation)`` of XTuner's own pack step (plugin not enabled)."""
    from xtuner.dataset.huggingface import pack_dataset as xtuner_pack_dataset
    from xtuner.dataset.huggingface import process_hf_dataset
    from xtuner.registry import BUILDER

    kwargs = copy.deepcopy(dict(dataset_cfg))
    kwargs.pop("type")
    shuffle = kwargs.pop("shuffle_before_pack", True)
    varlen = bool(kwargs.pop("use_varlen_attn", False))
    procs = kwargs.get("map_num_proc", 32)
    with counting_truncation() as truncation:
        dialogues = BUILDER.build(
            dict(
                kwargs,
                type=process_hf_dataset,
                pack_to_max_length=False,
                remove_unused_columns=True,
            )
        )
    if shuffle:  # as XTuner's pack_dataset does, before its Packer
        dialogues = dialogues.shuffle().flatten_indices(num_proc=procs)
    dialogues = dialogues.remove_columns(["length"])
    packed = xtuner_pack_dataset(dialogues, kwargs["max_length"], varlen, False, procs)
    return dialogues, packed, summed_figures(truncation)


def packing_figures(
    dialogues, packed, max_length: int, intern_repo: bool = False, progress: Progress = QUIET
) -> dict:
    """What the pack step did to ``dialogues`` (tokenized, stream order), JSON-ready, by blocks.

    Cut dialogues are counted from the stream order where the rows keep it (XTuner's cut), else
    by finding each dialogue whole among the packed documents.

    Args:
        packed: The packed rows built from them (``cumulative_len`` when recorded).
        intern_repo: One file's rows of XTuner's intern-repo packing (last partial row dropped).

    Returns:
        ``tokens`` / ``labels`` (``before``, ``after``, ``lost``), ``rows``, ``fill``, ``sft``,
        ``xtuner_cut``, ``split_long`` / ``split_pieces``, and ``cut_dialogues``, ``pieces``,
        ``unsupervised_pieces``, ``unsupervised_seen`` (None without boundaries in stream order).
    """
    lengths = row_lengths(dialogues)  # [n] in stream order
    rows = row_lengths(packed)
    starts = segment_starts(packed, rows)
    progress.stage(
        f"packing figures: {len(dialogues)} dialogues, {int(lengths.sum())} tokens, "
        f"{len(packed)} rows"
    )
    source = dialogue_pass(dialogues, progress)
    after = packed_pass(packed, dialogues, starts, progress)
    figures = {
        "dialogues": len(dialogues),
        "rows": len(packed),
        "max_length": max_length,
        "tokens": kept_counts(int(lengths.sum()), after["tokens"]),
        "labels": kept_counts(source["labels"], after["labels"]),
        "cut_dialogues": None,
        "pieces": None,
        "unsupervised_pieces": None,
        "unsupervised_seen": None,
    }
    xtuner_cuts = (
        intern_repo_cut_plan(lengths, max_length) if intern_repo else cut_plan(lengths, max_length)
    )
    figures.update(
        fill=round(after["tokens"] / max(len(packed) * max_length, 1), 4),
        sft=source["sft"],
        packer="intern_repo" if intern_repo else "process_hf_dataset",
        xtuner_cut={
            "rows": len(xtuner_cuts) - 1,
            "cut_dialogues": cut_dialogues(lengths, xtuner_cuts),
        },
    )
    # XTuner's cut keeps the stream in order; its intern-repo packer drops the tail (a prefix)
    in_order = after["in_order"]
    long = lengths > max_length
    figures["split_long"] = int(long.sum())
    figures["split_pieces"] = None
    if starts is None or not lengths.sum() or (figures["tokens"]["lost"] and not in_order):
        return figures  # no boundaries, or tokens dropped mid-stream (the shards' leftovers)
    unsupervised = after["unsupervised"]
    if in_order:
        doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        doc_of_segment = np.searchsorted(doc_starts, starts, side="right") - 1
        segment_lengths = np.diff(np.append(starts, after["tokens"]))
        piece = segment_lengths != lengths[doc_of_segment]  # [k] less than its whole dialogue
        cut = len(np.unique(doc_of_segment[piece]))
        pieces = int(piece.sum())
    else:  # rows in another order (whole-dialogue packing): find each dialogue whole
        piece = ~whole_matches(source["keys"], after["keys"])
        # A document longer than a row is split into max_length pieces by design (nothing to
        # keep whole): counted apart, never as a dialogue cut at a row edge.
        split = int((-(-lengths[long] // max_length)).sum())
        cut = len(lengths) - int((~piece).sum()) - int(long.sum())
        pieces = int(piece.sum()) - split
        figures["split_pieces"] = split
    figures.update(
        cut_dialogues=cut,
        pieces=pieces,
        unsupervised_pieces=int((unsupervised & piece).sum()),
        unsupervised_seen=int(unsupervised.sum()),
    )
    return figures


def intern_repo_figures(concat, packed_length: int) -> tuple[list[int], dict]:
    """``([n] document lengths in stream order, packing_figures of all files)`` of a built intern-repo
    ``ConcatDataset`` of ``packed_length`` rows (figures None without a file)."""
    from datasets import Dataset

    lengths, parts = [], []
    for packer in concat.datasets:
        source = packer.dataset
        order = [int(i) for i in packer.shuffled_indices]
        docs = source.select(order) if hasattr(source, "select") else [source[i] for i in order]
        columns = ("input_ids", "labels")
        dialogues = Dataset.from_dict(
            {k: [d[k] for d in docs] for k in columns} if isinstance(docs, list) else docs[:]
        ).select_columns(list(columns))
        rows = [packer[i] for i in range(len(packer))]
        packed = Dataset.from_dict({k: [r[k] for r in rows] for k in (*columns, "cumulative_len")})
        lengths += [len(ids) for ids in dialogues["input_ids"]]
        parts.append(packing_figures(dialogues, packed, packed_length, intern_repo=True))
    return lengths, _summed(parts, packed_length) if parts else None


SUMMED = (
    "dialogues",
    "rows",
    "cut_dialogues",
    "split_long",
    "split_pieces",
    "pieces",
    "unsupervised_pieces",
    "unsupervised_seen",
)


def _summed(parts: list[dict], max_length: int) -> dict:
    """The figures of several files' packs as one (counts summed, the fill recomputed)."""
    total = dict(parts[0])
    for key in SUMMED:
        values = [p[key] for p in parts]
        total[key] = None if None in values else sum(values)
    for key in ("tokens", "labels"):
        total[key] = {k: sum(p[key][k] for p in parts) for k in ("before", "after", "lost")}
    total["xtuner_cut"] = {
        k: sum(p["xtuner_cut"][k] for p in parts) for k in ("rows", "cut_dialogues")
    }
    total["sft"] = any(p["sft"] for p in parts)
    total["fill"] = round(total["tokens"]["after"] / max(total["rows"] * max_length, 1), 4)
    return total
