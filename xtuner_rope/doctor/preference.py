"""What ``xtuner-rope doctor`` shows for XTuner's preference pairs (DPO, ORPO, reward model).

:func:`preference_figures` describes the pairs (lengths, pairs dropped by
``PackedDatasetWrapper``, pairs per row, real-token share), not the packed rows.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from os.path import commonprefix

from mmengine.config import Config

from xtuner_rope.config.preference import preference_dataset
from xtuner_rope.doctor.stats import length_percentiles
from xtuner_rope.doctor.truncation import truncation_lines


def _pairs(dataset_cfg: dict) -> tuple[list[dict], dict | None]:
    """The tokenized pairs before packing, and XTuner's cut at ``max_length`` (None uncounted)."""
    from xtuner.registry import BUILDER

    unpacked = copy.deepcopy(dataset_cfg)
    unpacked["use_varlen_attn"] = False
    built = BUILDER.build(unpacked)
    return list(built), getattr(built, "truncation", None)


class PairSamples(Sequence):
    """An unpacked preference dataset as the doctor's samples: pair ``i``'s two responses end to
    end."""

    def __init__(self, dataset: Sequence[Mapping]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        pair = self.dataset[index]
        return {
            "input_ids": list(pair["chosen_ids"]) + list(pair["rejected_ids"]),
            "labels": list(pair["chosen_labels"]) + list(pair["rejected_labels"]),
        }


def doctor_samples(dataset: Sequence[Mapping]) -> Sequence[Mapping]:
    """The items the doctor scans: :class:`PairSamples` for unpacked pairs, else ``dataset``."""
    first = dataset[0] if len(dataset) else {}
    unpacked_pairs = "input_ids" not in first and "chosen_ids" in first
    return PairSamples(dataset) if unpacked_pairs else dataset


def preference_figures(cfg: Config, dataset) -> dict | None:
    """Pair figures of a preference config's built train ``dataset`` (``PackedDatasetWrapper``
    when packed); None for other datasets."""
    dataset_cfg = preference_dataset(cfg)
    if dataset_cfg is None:
        return None
    pairs, counted = _pairs(dataset_cfg)
    max_packed = dataset_cfg.get("max_packed_length", 16384)
    packed = bool(dataset_cfg.get("use_varlen_attn"))
    totals = [len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs]
    dropped = sum(t > max_packed for t in totals) if packed else 0
    rows = len(dataset) if packed else None
    max_length = dataset_cfg.get("max_length")
    return {
        "kind": "reward" if dataset_cfg.get("is_reward") else "dpo/orpo",
        "pairs": len(pairs),
        "max_length": max_length,
        # is_reference pairs (tokenize_ref): responses cut here, prompts to fit max_length
        "max_response_length": dataset_cfg.get("max_response_length", 4096)
        if dataset_cfg.get("is_reference")
        else None,
        "packed": packed,
        "max_packed_length": max_packed if packed else None,
        "truncated_responses": counted["responses"]
        if counted
        else sum(  # uncounted (max_length not an int): those as long as max_length
            (len(p["chosen_ids"]) >= max_length) + (len(p["rejected_ids"]) >= max_length)
            for p in pairs
        )
        if max_length
        else 0,
        "lengths": {
            "prompt": length_percentiles(
                # chosen and rejected share the prompt (and any common opening)
                [len(commonprefix([p["chosen_ids"], p["rejected_ids"]])) for p in pairs]
            ),
            "chosen": length_percentiles([len(p["chosen_ids"]) for p in pairs]),
            "rejected": length_percentiles([len(p["rejected_ids"]) for p in pairs]),
        },
        "dropped_over_max_packed_length": dropped,
        "rows": rows,
        "longest_pair": max(totals, default=0),
        "pairs_per_row": (len(pairs) - dropped) / rows if rows else None,
        "real_token_share": (sum(t for t in totals if t <= max_packed) / (rows * max_packed))
        if rows
        else None,
    }


def _pct(values: dict) -> str:
    return " ".join(f"{k}={'n/a' if v is None else f'{v:g}'}" for k, v in values.items())


def preference_lines(report: dict) -> list[str]:
    """The doctor's dataset lines for preference data (instead of the dialogue lines)."""
    p, samples = report["preference"], report["samples"]
    cut = (
        f"max_length={p['max_length']} per response ({p['truncated_responses']} responses "
        "cut to it)"
        if p.get("max_response_length") is None
        else f"max_length={p['max_length']} per sequence, max_response_length="
        f"{p['max_response_length']} ({p['truncated_responses']} responses cut to it)"
    )
    lines = [f"dataset      {report['dataset']['type']} ({p['kind']}): {p['pairs']} pairs, {cut}"]
    lines += [f"lengths      {part:<8} {_pct(v)}" for part, v in p["lengths"].items()]
    if p["packed"]:
        lines.append(
            f"packing      PackedDatasetWrapper, max_packed_length={p['max_packed_length']}: "
            f"{p['pairs'] - p['dropped_over_max_packed_length']} pairs -> {p['rows']} rows "
            f"({p['pairs_per_row']:.2f} pairs per row, {p['real_token_share']:.1%} of "
            f"max_packed_length filled); {p['dropped_over_max_packed_length']} pairs dropped "
            "(chosen + rejected longer than max_packed_length)"
        )
    lines += truncation_lines(report.get("truncation"))
    lines.append("samples      " + "  ".join(f"{k}={v['count']}" for k, v in samples.items()))
    return lines


def preference_warnings(report: dict) -> list[str]:
    """Pairs XTuner drops silently (it only logs the count)."""
    p = report.get("preference")
    if not p or not p["dropped_over_max_packed_length"]:
        return []
    return [
        f"{p['dropped_over_max_packed_length']} of {p['pairs']} pairs are longer than "
        f"max_packed_length={p['max_packed_length']} (chosen + rejected) and are dropped by "
        f"PackedDatasetWrapper: raise max_packed_length to {p['longest_pair']} (the longest "
        "pair: keeps every pair)"
    ]
