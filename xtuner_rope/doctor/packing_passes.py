"""The passes of :func:`doctor.packing.packing_figures` over the token columns, block by block."""

from __future__ import annotations

import numpy as np

from xtuner_rope.data.collate import IGNORE_INDEX
from xtuner_rope.data.dialogue_keys import segment_keys
from xtuner_rope.doctor.progress import Progress
from xtuner_rope.doctor.token_columns import list_column, row_lengths, token_blocks


def segment_starts(packed, row_lengths: np.ndarray) -> np.ndarray | None:
    """``[k]`` stream offsets where a packed document starts (None without boundaries)."""
    if "cumulative_len" not in packed.column_names:
        return None
    values, offsets = list_column(packed, "cumulative_len")
    row_starts = np.cumsum(row_lengths) - row_lengths
    sizes = np.diff(offsets)
    keep = np.ones(len(values), dtype=bool)
    keep[offsets[1:][sizes > 0] - 1] = False  # each row's last bound is its length
    return (values + np.repeat(row_starts, sizes))[keep]


class PrefixCheck:
    """Whether the packed tokens, fed block by block, are the dialogues' stream from its start."""

    def __init__(self, dialogues) -> None:
        self._stream = (b["input_ids"] for _, _, b in token_blocks(dialogues, ("input_ids",)))
        self._pending = np.zeros(0, dtype=np.int64)
        self.equal = True

    def feed(self, ids: np.ndarray) -> None:
        while self.equal and len(self._pending) < len(ids):
            more = next(self._stream, None)
            if more is None:
                self.equal = False  # more packed tokens than the stream holds
            else:
                self._pending = np.concatenate([self._pending, more])
        if self.equal:
            self.equal = np.array_equal(ids, self._pending[: len(ids)])
            self._pending = self._pending[len(ids) :]


def packed_pass(packed, dialogues, starts, progress: Progress) -> dict:
    """One pass over the packed rows: labels kept, document keys and supervision, stream order."""
    prefix = PrefixCheck(dialogues)
    labels = 0
    unsupervised, keys = [], []
    total = int(row_lengths(packed).sum())
    with progress.bar(total, f"packing figures, {len(packed)} rows") as bar:
        offset = 0
        for _, _, block in token_blocks(packed):
            ids, row_labels = block["input_ids"], block["labels"]
            labels += int((row_labels != IGNORE_INDEX).sum())
            prefix.feed(ids)
            local = np.zeros(0, dtype=np.int64)
            if starts is not None:
                local = starts[(starts >= offset) & (starts < offset + len(ids))] - offset
            if len(local):
                used = row_labels != IGNORE_INDEX
                used[local] = False  # a document's first label is never predicted from it
                unsupervised.append(np.add.reduceat(used.astype(np.int64), local) == 0)
                keys.append(segment_keys(ids, local))
            offset += len(ids)
            bar.update(len(ids))
    return {
        "tokens": offset,
        "labels": labels,
        "in_order": prefix.equal,
        "unsupervised": np.concatenate(unsupervised) if unsupervised else np.zeros(0, bool),
        "keys": np.concatenate(keys) if keys else np.zeros((0, 3), np.uint64),
    }


def dialogue_pass(dialogues, progress: Progress) -> dict:
    """One pass over the dialogues as stored: supervised labels, prompts, each one's key."""
    labels, sft, keys = 0, False, []
    total = int(row_lengths(dialogues).sum())
    with progress.bar(total, f"packing figures, {len(dialogues)} dialogues") as bar:
        for _, lengths, block in token_blocks(dialogues, table_order=True):
            prompt = block["labels"] == IGNORE_INDEX
            labels += int(len(prompt) - prompt.sum())
            sft = sft or bool(prompt.any())
            keys.append(segment_keys(block["input_ids"], np.cumsum(lengths) - lengths))
            bar.update(len(prompt))
    return {
        "labels": labels,
        "sft": sft,
        "keys": np.concatenate(keys) if keys else np.zeros((0, 3), np.uint64),
    }
