"""Packing figures of one collated batch: documents, real tokens, lengths, unsupervised documents.

Documents are read from ``position_ids`` (``cumulative_len`` may be popped already). Padding is
a row's tail after its last real token: ``attention_mask`` False, else ``input_ids == pad_index``
with label -100.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["BatchStats", "batch_stats", "segment_ids"]

IGNORE_INDEX = -100


@dataclass
class BatchStats:
    """Counts of one batch, added up over a logging window with ``+``: ``tokens`` counts padding,
    ``real_tokens`` not; ``max_position`` is the largest position fed to the RoPE;
    ``unsupervised_documents`` have every label -100 after their first."""

    rows: int = 0
    tokens: int = 0
    real_tokens: int = 0
    documents: int = 0
    longest_document: int = 0
    max_position: int = 0
    unsupervised_documents: int = 0

    def __add__(self, other: BatchStats) -> BatchStats:
        return BatchStats(
            self.rows + other.rows,
            self.tokens + other.tokens,
            self.real_tokens + other.real_tokens,
            self.documents + other.documents,
            max(self.longest_document, other.longest_document),
            max(self.max_position, other.max_position),
            self.unsupervised_documents + other.unsupervised_documents,
        )


def segment_ids(
    position_ids: torch.Tensor | None,
    shape: tuple[int, int],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b, s]`` long segment numbers, row by row, +1 at each segment start (column 0 of every
    row, a position restarting at 0, a row's masked tail); ``position_ids`` None: one document
    per row."""
    b, s = shape
    starts = torch.zeros(b, s, dtype=torch.bool) if position_ids is None else position_ids == 0
    if attention_mask is not None:
        mask = attention_mask.bool()
        starts[:, 1:] |= mask[:, :-1] & ~mask[:, 1:]  # first masked column after a real one
    starts[:, 0] = True
    return starts.reshape(-1).long().cumsum(0).reshape(b, s) - 1


def _padding_tokens(data: Mapping, pad_index: int) -> torch.Tensor:
    """``[b, s]`` bool, True on tokens that look like padding (see the module docstring)."""
    if data.get("attention_mask") is not None:
        return ~data["attention_mask"].bool()
    return (data["input_ids"] == pad_index) & (data["labels"] == IGNORE_INDEX)


def _row_tails(real: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: the tokens after each row's last real token (the row's padding segments)."""
    b, s = real.shape
    last = s - 1 - real.flip(1).to(torch.uint8).argmax(1)  # [b] column of the last real token
    last = torch.where(real.any(1), last, -1)
    return torch.arange(s)[None, :] > last[:, None]


def batch_stats(data: Mapping, pad_index: int = 0) -> BatchStats:
    """The :class:`BatchStats` of one collated batch (``input_ids``, ``labels``, optional
    ``position_ids`` / ``attention_mask``, all ``[b, s]``; ``pad_index`` pads ``input_ids``).

    Raises:
        ValueError: ``input_ids`` is not ``[b, s]`` or another field has another shape.
    """
    input_ids = data["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(
            f"batch_stats: field 'input_ids': expected a [b, s] tensor, got shape "
            f'{list(input_ids.shape)}. Pass data_batch["data"] of a collated batch.'
        )
    b, s = input_ids.shape
    for field in ("labels", "position_ids", "attention_mask"):
        if data.get(field) is not None and tuple(data[field].shape) != (b, s):
            raise ValueError(
                f"batch_stats: field {field!r}: expected shape {[b, s]} like "
                f"input_ids, got {list(data[field].shape)}. Collate all fields "
                "together."
            )
    position_ids = data.get("position_ids")
    seg = segment_ids(position_ids, (b, s), data.get("attention_mask")).reshape(-1)
    n_seg = int(seg[-1]) + 1
    real = ~_row_tails(~_padding_tokens(data, pad_index)).reshape(-1)
    # A label is used by the loss unless it is -100 or the first of its segment.
    first = torch.ones_like(real)
    first[1:] = seg[1:] != seg[:-1]
    used = (data["labels"].reshape(-1) != IGNORE_INDEX) & ~first
    # One integer bincount of (segment, real, used) gives every per-segment count at once.
    counts = torch.bincount(seg * 4 + real * 2 + used, minlength=4 * n_seg).reshape(n_seg, 4)
    docs = counts[:, 2] + counts[:, 3] > 0  # segments of the row's tail hold no real token
    unsupervised = docs & (counts[:, 1] + counts[:, 3] == 0)
    doc_lengths = counts.sum(1) * docs
    peak = position_ids.max() if position_ids is not None else torch.tensor(s - 1)
    # One conversion to Python ints: this runs every iteration, small ops dominate its cost.
    n_docs, real, longest, n_unsup, max_pos = torch.stack(
        [docs.sum(), doc_lengths.sum(), doc_lengths.max(), unsupervised.sum(), peak]
    ).tolist()
    return BatchStats(
        rows=b,
        tokens=b * s,
        real_tokens=real,
        documents=n_docs,
        longest_document=longest,
        max_position=max_pos,
        unsupervised_documents=n_unsup,
    )
