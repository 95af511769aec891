"""The held-out set's counts: its size after packing and its overlap with the training data.

Read by ``xtuner-rope doctor`` and logged by ``HeldOutCurvesHook``. Overlap means equal token
ids (same template and tokenizer).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from xtuner_rope.config.fields import type_name
from xtuner_rope.config.heldout.shortcut import IMAGE_DATASETS
from xtuner_rope.data.dialogue_keys import key_bytes, sequences_key_bytes

IGNORE_INDEX = -100
COLUMNS = ("input_ids", "labels", "cumulative_len", "position_ids")
CHUNK = 1024  # rows read at a time


def _ints(value: object) -> np.ndarray:
    """``[n]`` int64 ids of a list, tensor or array."""
    return np.asarray(value, dtype=np.int64).reshape(-1)


def _list_column(column) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of a pyarrow list column: row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]`` (numpy views, no Python lists)."""
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy() - array.offsets[0].as_py()
    values = array.flatten().to_numpy(zero_copy_only=False)
    return values, offsets


def rows_of(dataset: object) -> Iterator[Mapping]:
    """The rows of a built dataset as dicts of ``COLUMNS``; an HF ``Dataset`` in Arrow chunks,
    each row a numpy view (millions of dialogues hashed without Python lists)."""
    dataset = getattr(dataset, "text_data", dataset)  # LLaVA: its tokenized text, no image
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):
        columns = [c for c in COLUMNS if c in names]
        view = dataset.select_columns(columns).with_format("arrow")
        for chunk in view.iter(batch_size=CHUNK):  # a pyarrow Table of <= CHUNK rows
            lists = {c: _list_column(chunk.column(c)) for c in columns}
            for i in range(chunk.num_rows):
                yield {
                    c: values[offsets[i] : offsets[i + 1]] for c, (values, offsets) in lists.items()
                }
    else:
        for i in range(len(dataset)):
            yield dataset[i]


def document_bounds(row: Mapping) -> list[int]:
    """``[k + 1]`` document boundaries of one row (``[0, n]`` for a plain row)."""
    n = len(_ints(row["input_ids"]))
    if row.get("cumulative_len") is not None:
        cu = [int(c) for c in _ints(row["cumulative_len"]) if 0 < c < n]
        return [0, *cu, n]
    if row.get("position_ids") is not None:
        starts = np.flatnonzero(_ints(row["position_ids"]) == 0)
        return [0, *[int(c) for c in starts if c > 0], n]
    return [0, n]


def dialogue_keys(dialogues: Iterable[Sequence[int]]) -> set[bytes]:
    """Identities of dialogues given as token-id sequences (``dataset['input_ids']``): the
    project's one dialogue hash, :func:`xtuner_rope.data.dialogue_keys.segment_keys`."""
    return set(sequences_key_bytes(dialogues))


def document_keys(dataset: object) -> set[bytes] | None:
    """Identities of every document of a built (possibly packed) dataset's rows; None for an
    image dataset without tokenized text (InternVL's: counting would cost an epoch of loading)."""
    text = getattr(dataset, "text_data", dataset)
    if not isinstance(getattr(text, "column_names", None), list) and (
        type(dataset).__name__ in IMAGE_DATASETS
    ):
        return None
    keys = set()
    for row in rows_of(dataset):
        ids, bounds = _ints(row["input_ids"]), document_bounds(row)
        keys |= set(key_bytes(ids[: bounds[-1]], np.asarray(bounds[:-1], dtype=np.int64)))
    return keys


def row_capacity(dataset_cfg: object, collate_cfg: object) -> int | None:
    """``max_length`` the held-out rows are packed to: by the collate function
    (``pack=True``), else by the dataset (``pack_to_max_length``, XTuner's default True; LLaVA
    and InternVL datasets never pack); None when nothing packs."""
    get = getattr(collate_cfg, "get", None)
    if get is not None and get("pack") and get("max_length"):
        return get("max_length")
    get = getattr(dataset_cfg, "get", None)
    if get is None or type_name(get("type")) in IMAGE_DATASETS:  # one sample per item
        return None
    return get("max_length") if get("pack_to_max_length", True) else None


def collated_rows(dataset: object, collate: object, batch_size: int) -> int:
    """Rows the collate function makes of the dataset in order, ``batch_size`` items a batch."""
    rows, n = 0, len(dataset)
    for start in range(0, n, batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, n))])
        rows += batch["data"]["input_ids"].shape[0]  # [b, s]
    return rows


def heldout_counts(
    heldout: object, training: set[bytes] | None, max_length: int | None, rows: int | None = None
) -> dict:
    """Size of the held-out set and its overlap with the training dialogues.

    Args:
        heldout: The built held-out dataset (rows: ``input_ids``, ``labels`` ``[n]`` each, and
            ``cumulative_len`` ``[k + 1]`` when packed).
        training: :func:`document_keys` of the training data; None: not counted.
        max_length: :func:`row_capacity` of packed held-out rows, else None (no fill).
        rows: :func:`collated_rows` after an online-packing collate; None: the dataset's rows.

    Returns:
        ``{'dialogues', 'supervised_tokens', 'tokens', 'rows', 'max_length', 'fill',
        'in_training'}``.
    """
    dialogues = supervised = tokens = items = overlap = 0
    for row in rows_of(heldout):
        ids, labels = _ints(row["input_ids"]), _ints(row["labels"])
        bounds = document_bounds(row)
        items, tokens = items + 1, tokens + len(ids)
        keys = key_bytes(ids[: bounds[-1]], np.asarray(bounds[:-1], dtype=np.int64))
        for (a, e), key in zip(zip(bounds, bounds[1:]), keys):
            dialogues += 1
            supervised += int((labels[a + 1 : e] != IGNORE_INDEX).sum())
            overlap += training is not None and key in training
    rows = items if rows is None else rows
    return {
        "dialogues": dialogues,
        "supervised_tokens": supervised,
        "tokens": tokens,
        "rows": rows,
        "max_length": max_length,
        "fill": tokens / (rows * max_length) if max_length and rows else None,
        "in_training": overlap if training is not None else None,
    }


def heldout_line(counts: dict) -> str:
    """One line of the counts, as the doctor prints and the run logs them."""
    packed = (
        f" packed to max_length={counts['max_length']} (fill {counts['fill']:.1%})"
        if counts["fill"] is not None
        else ""
    )
    overlap = (
        f"in the training data too: {counts['in_training']} dialogues (same token ids)"
        if counts["in_training"] is not None
        else "overlap with the training data not counted (its image dataset keeps no "
        "tokenized text: counting would build every training sample, images included)"
    )
    return (
        f"{counts['dialogues']} dialogues, {counts['supervised_tokens']} supervised tokens, "
        f"{counts['rows']} rows{packed}; {overlap}"
    )


def overlap_warning(counts: dict) -> str | None:
    """The warning (doctor and start-up log) for held-out dialogues in the training data too."""
    if not counts.get("in_training"):
        return None
    return (
        f"{counts['in_training']} of {counts['dialogues']} held-out dialogues are in the "
        "training data too (same token ids): the held-out loss is partly a training loss; "
        "remove them from one of the files"
    )


__all__ = [
    "collated_rows",
    "dialogue_keys",
    "document_bounds",
    "document_keys",
    "heldout_counts",
    "heldout_line",
    "overlap_warning",
    "row_capacity",
    "rows_of",
]
