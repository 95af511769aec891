"""What a dataset looks like to the plugin: per-sample checks and the collate plan, simulated.

A label is *supervised* when it is not ``IGNORE_INDEX`` and not a document's first label.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from xtuner_rope.data.collate import IGNORE_INDEX

FIRST_INDICES = 10  # how many offending indices a report lists per kind
PERCENTILES = (0, 50, 90, 99, 100)


@dataclass
class Occurrences:
    """How often something happened and where first (sample or batch indices)."""

    count: int = 0
    first_indices: list[int] = field(default_factory=list)

    def add(self, index: int) -> None:
        self.count += 1
        if len(self.first_indices) < FIRST_INDICES:
            self.first_indices.append(index)

    def add_all(self, indices: np.ndarray) -> None:
        """:meth:`add` each of ``indices`` (increasing), at once."""
        room = FIRST_INDICES - len(self.first_indices)
        self.first_indices += [int(i) for i in indices[:room]]
        self.count += len(indices)


def _as_list(value: object) -> list[int]:
    if value is None:
        return []
    tolist = getattr(value, "tolist", None)  # tensors, arrays
    flat = tolist() if tolist is not None else list(value)
    return [int(v) for v in np.asarray(flat).reshape(-1)]


def document_starts(item: Mapping) -> list[int]:
    """First column of every document of one dataset item (``[0]`` plain, ``[]`` empty); packed
    items carry ``cumulative_len`` ``[k + 1]`` or ``position_ids`` ``[n]`` (0 at each start)."""
    n = len(_as_list(item.get("input_ids")))
    if n == 0:
        return []
    if item.get("cumulative_len") is not None:
        return [c for c in _as_list(item["cumulative_len"])[:-1] if c < n] or [0]
    if item.get("position_ids") is not None:
        positions = _as_list(item["position_ids"])
        return sorted({0} | {col for col, p in enumerate(positions) if p == 0})
    return [0]


def supervised_count(item: Mapping) -> int:
    """Labels of one item that the loss uses (see the module docstring)."""
    labels = _as_list(item.get("labels"))
    first = set(document_starts(item))
    return sum(1 for col, label in enumerate(labels) if label != IGNORE_INDEX and col not in first)


@dataclass
class SampleScan:
    """Per-sample facts of a dataset: ``[n]`` lengths and supervised counts, and the issues."""

    lengths: list[int] = field(default_factory=list)
    supervised: list[int] = field(default_factory=list)
    documents: int = 0
    issues: dict[str, Occurrences] = field(
        default_factory=lambda: {
            k: Occurrences()
            for k in ("empty", "unsupervised", "over_long", "truncated", "length_mismatch")
        }
    )


def scan_samples(
    dataset: Sequence[Mapping],
    *,
    collate_max_length: int | None,
    truncation_length: int | None,
    progress: bool = True,
) -> SampleScan:
    """Check every sample of a built dataset; issue indices are sample indices. Samples longer
    than ``collate_max_length`` are ``over_long``, those exactly ``truncation_length`` long were
    probably cut (None: not checked)."""
    scan = SampleScan()
    enabled = getattr(progress, "enabled", progress)  # a doctor.progress.Progress, or a bool
    for index in tqdm(range(len(dataset)), desc="doctor: samples", disable=not enabled):
        item = dataset[index]
        n, n_labels = len(_as_list(item.get("input_ids"))), len(_as_list(item.get("labels")))
        supervised = supervised_count(item)
        scan.lengths.append(n)
        scan.supervised.append(supervised)
        scan.documents += len(document_starts(item))
        checks = {
            "empty": n == 0,
            "unsupervised": n > 0 and supervised == 0,
            "over_long": collate_max_length is not None and n > collate_max_length,
            "truncated": truncation_length is not None and n == truncation_length,
            "length_mismatch": n != n_labels,
        }
        for kind, hit in checks.items():
            if hit:
                scan.issues[kind].add(index)
    return scan


def length_percentiles(lengths: Sequence[int]) -> dict[str, float | None]:
    """``p0 ... p100`` of the sample lengths (linear interpolation, numpy's default)."""
    values = np.percentile(lengths, PERCENTILES) if len(lengths) else [None] * len(PERCENTILES)
    return {f"p{q}": None if v is None else float(v) for q, v in zip(PERCENTILES, values)}


def percentiles_text(values: Mapping) -> str:
    """``p0=... p50=...`` of :func:`length_percentiles`, for the summary lines."""
    return "  ".join(f"{k}={'n/a' if v is None else f'{v:g}'}" for k, v in values.items())


def _batch_shape(out: object) -> tuple[int, int]:
    """``(b, s)`` of a collated batch (``{'data': {...}}`` or the inner dict)."""
    data = out.get("data", out) if isinstance(out, Mapping) else None
    ids = data.get("input_ids") if isinstance(data, Mapping) else None
    if ids is None or getattr(ids, "dim", lambda: 0)() != 2:
        raise TypeError(f"expected a batch with a [b, s] input_ids tensor, got {type(out)}")
    return int(ids.shape[0]), int(ids.shape[1])


@dataclass
class CollatePlan:
    """The first batches of the sampler (dataset order), collated as the config does."""

    batches: int = 0
    rows: list[int] = field(default_factory=list)
    shapes: list[tuple[int, int]] = field(default_factory=list)  # (b, s) of each batch
    real_tokens: int = 0
    config_slots: int = 0  # sum of b * s of the config's collate function
    padded_slots: int = 0  # XTuner default_collate_fn: every sample padded to the batch's longest
    unsupervised_batches: Occurrences = field(default_factory=Occurrences)
    errors: list[dict] = field(default_factory=list)
    collate_warnings: list[str] = field(default_factory=list)


def simulate_collate(
    dataset: Sequence[Mapping],
    collate_fn: Callable,
    batch_size: int,
    max_batches: int,
    scan: SampleScan,
    progress: bool = True,
) -> CollatePlan:
    """Collate the first ``max_batches`` batches of ``batch_size`` consecutive samples (the last
    short batch kept) with the config's bound ``collate_fn``; ``scan``: :func:`scan_samples`'.

    A refused batch goes to ``errors``, left out of the token shares; a batch without any
    supervised label to ``unsupervised_batches``.
    """
    plan = CollatePlan()
    n_batches = min(max_batches, -(-len(dataset) // batch_size))
    for batch in tqdm(range(n_batches), desc="doctor: batches", disable=not progress):
        indices = range(batch * batch_size, min((batch + 1) * batch_size, len(dataset)))
        plan.batches += 1
        if sum(scan.supervised[i] for i in indices) == 0:
            plan.unsupervised_batches.add(batch)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                b, s = _batch_shape(collate_fn([dataset[i] for i in indices]))
        # KeyError: XTuner's default_collate_fn(use_varlen_attn=True) on rows without boundaries
        except (ValueError, TypeError, KeyError, AssertionError, RuntimeError) as exc:
            plan.errors.append(
                {
                    "batch": batch,
                    "first_sample": indices[0],
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
            continue
        plan.collate_warnings += [f"batch {batch}: {w.message}" for w in caught]
        lengths = [scan.lengths[i] for i in indices]
        plan.rows.append(b)
        plan.shapes.append((b, s))
        plan.real_tokens += sum(lengths)
        plan.config_slots += b * s
        plan.padded_slots += len(lengths) * max(lengths)
    return plan


def plan_summary(plan: CollatePlan) -> dict:
    """The plan's numbers, JSON-ready: rows per step and real-token shares."""

    def share(slots: int) -> float | None:
        return plan.real_tokens / slots if slots else None

    config_share, padded_share = share(plan.config_slots), share(plan.padded_slots)
    return {
        "batches": plan.batches,
        "rows_per_step": {
            "mean": float(np.mean(plan.rows)) if plan.rows else None,
            "min": min(plan.rows, default=None),
            "max": max(plan.rows, default=None),
        },
        "real_tokens": plan.real_tokens,
        "config_slots": plan.config_slots,
        "padded_slots": plan.padded_slots,
        "config_share": config_share,
        "padded_share": padded_share,
        "ideal_speedup": (config_share / padded_share) if config_share and padded_share else None,
        "unsupervised_batches": vars(plan.unsupervised_batches),
        "errors": plan.errors,
        "collate_warnings": plan.collate_warnings[:FIRST_INDICES],
    }
