"""Dataset items as ``rope_collate_fn`` reads them: parsed, checked, one ``Sample`` each."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from xtuner_rope.ops.inputs import to_int_tensor
from xtuner_rope.ops.packing import cumulative_from_position_ids, position_ids_from_cumulative

__all__ = [
    "Sample",
    "parse_sample",
    "check_id_range",
    "is_supervised",
    "item_error",
    "IGNORE_INDEX",
]

# Same value as xtuner.utils (checked in tests); defined here so importing the collate
# function does not pull in xtuner.utils' templates and transformers.
IGNORE_INDEX = -100


@dataclass
class Sample:
    """One dataset item, checked: ``[n]`` long ids/labels and its ``[k + 1]`` boundaries."""

    index: int
    input_ids: torch.Tensor
    labels: torch.Tensor
    cu: torch.Tensor
    carries_boundaries: bool  # the item came with cumulative_len / position_ids


def item_error(
    index: int, field: str, expected: str, got: object, fix: str, document: int | None = None
) -> ValueError:
    where = f"sample {index}" + ("" if document is None else f", document {document}")
    return ValueError(
        f"rope_collate_fn: {where}, field {field!r}: expected {expected}, got {got}. {fix}"
    )


def _as_1d_ints(index: int, item: Mapping, field: str) -> torch.Tensor:
    """Read ``item[field]`` (list, tuple, array or tensor of ints) as a ``[n]`` long tensor."""
    if field not in item:
        raise item_error(
            index,
            field,
            "a dict with 'input_ids' and 'labels' as XTuner datasets yield",
            f"keys {sorted(item)}",
            "Check the dataset map function.",
        )
    tensor = to_int_tensor(
        item[field],
        f"rope_collate_fn: sample {index}, field {field!r}",
        "Tokenize to ints in the dataset map function.",
    )
    if tensor.dim() != 1:
        raise item_error(
            index,
            field,
            "a flat sequence of ints",
            f"shape {list(tensor.shape)}",
            "Give one sequence per item (the collate function builds the batch).",
        )
    return tensor.long()


def check_id_range(samples: list[Sample]) -> None:
    """Ids are >= 0; labels too, or IGNORE_INDEX (one test, then the first bad value named)."""
    ids = torch.cat([s.input_ids for s in samples])
    labels = torch.cat([s.labels for s in samples])
    if not bool(((ids < 0) | ((labels < 0) & (labels != IGNORE_INDEX))).any()):
        return
    for s in samples:
        for field, values in (("input_ids", s.input_ids), ("labels", s.labels)):
            bad = values < 0
            if field == "labels":
                bad &= values != IGNORE_INDEX
            if bool(bad.any()):
                col = _first_bad(bad)
                extra = f" or {IGNORE_INDEX}" if field == "labels" else ""
                raise item_error(
                    s.index,
                    field,
                    f"token ids >= 0{extra} (column {col})",
                    int(values[col]),
                    "Check the tokenizer and the label masking "
                    f"(only {IGNORE_INDEX} marks an unsupervised token).",
                )


def _first_bad(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0])


def _check_cumulative(index: int, cu: torch.Tensor, n: int) -> None:
    """``cu`` must start at 0, strictly increase and end at ``n`` (one item's length)."""
    fix = (
        "Rebuild the pack with xtuner's Packer, or give cumulative_len = [0, ..., len(input_ids)]."
    )
    if cu.numel() < 2 or int(cu[0]) != 0:
        raise item_error(
            index,
            "cumulative_len",
            "a list starting at 0 with at least 2 entries",
            cu.tolist(),
            fix,
        )
    steps = cu[1:] - cu[:-1]
    if bool((steps <= 0).any()):
        d = _first_bad(steps <= 0)
        raise item_error(
            index,
            "cumulative_len",
            f"strictly increasing boundaries (document {d} empty or reversed)",
            f"cumulative_len[{d}:{d + 2}] = {cu[d : d + 2].tolist()}",
            "Drop empty documents before packing. " + fix,
            document=d,
        )
    if int(cu[-1]) != n:
        raise item_error(
            index, "cumulative_len", f"last boundary == len(input_ids) == {n}", int(cu[-1]), fix
        )


def _boundaries(index: int, item: Mapping, n: int) -> tuple[torch.Tensor, bool]:
    """Boundaries of one item: from ``cumulative_len``, else ``position_ids``, else one document."""
    has_cu, has_pos = item.get("cumulative_len") is not None, item.get("position_ids") is not None
    if has_cu:
        cu = _as_1d_ints(index, item, "cumulative_len")
        _check_cumulative(index, cu, n)
    elif has_pos:
        cu = cumulative_from_position_ids(_as_1d_ints(index, item, "position_ids")).long()
    else:
        return torch.tensor([0, n], dtype=torch.long), False
    if has_pos:
        got = _as_1d_ints(index, item, "position_ids")
        if got.numel() != n:
            raise item_error(
                index,
                "position_ids",
                f"len(input_ids) == {n} entries",
                got.numel(),
                "Give one position per token.",
            )
        want = position_ids_from_cumulative(cu)
        if not torch.equal(got, want):
            col = _first_bad(got != want)
            d = int(torch.searchsorted(cu, col, right=True)) - 1
            raise item_error(
                index,
                "position_ids",
                f"{int(want[col])} at column {col} (0 at each document start, +1 within)",
                int(got[col]),
                "Restart positions at every document (cumulative_len).",
                document=d,
            )
    return cu, True


def parse_sample(index: int, item: object) -> Sample:
    if not isinstance(item, Mapping):
        raise TypeError(
            f"rope_collate_fn: sample {index}: expected a dict with input_ids and "
            f"labels, got {type(item).__name__}."
        )
    input_ids = _as_1d_ints(index, item, "input_ids")
    labels = _as_1d_ints(index, item, "labels")
    n = input_ids.numel()
    if n == 0:
        raise item_error(
            index,
            "input_ids",
            "at least 1 token",
            "0 tokens (an empty sample)",
            "Filter empty samples out of the dataset.",
        )
    if labels.numel() != n:
        raise item_error(
            index,
            "labels",
            f"len(labels) == len(input_ids) == {n}",
            labels.numel(),
            "Give one label per token (IGNORE_INDEX=-100 where not supervised).",
        )
    cu, carried = _boundaries(index, item, n)
    return Sample(index, input_ids, labels, cu, carried)


def is_supervised(sample: Sample) -> bool:
    """True if some label is used by the loss: a document's first label never is (the shift
    predicts it from the previous document, or from nothing at column 0)."""
    used = sample.labels != IGNORE_INDEX
    used[sample.cu[:-1]] = False
    return bool(used.any())
