"""``rope_collate_fn``: XTuner's batch structure with per-document RoPE positions."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from numbers import Integral

import torch

from xtuner_rope.batch.items import (
    IGNORE_INDEX,
    Sample,
    check_id_range,
    is_supervised,
    item_error,
    parse_sample,
)
from xtuner_rope.ops.inputs import show
from xtuner_rope.ops.packing import (
    cumulative_from_lengths,
    lengths_from_cumulative,
    padded_length,
    plan_packs,
    position_ids_from_starts,
    segment_starts_from_cumulative,
)

__all__ = ["rope_collate_fn", "IGNORE_INDEX", "DEFAULT_PAD_TOKEN_INDEX"]

# Same value as xtuner.utils (checked in tests), like IGNORE_INDEX.
DEFAULT_PAD_TOKEN_INDEX = 0


def _apply_policy(samples: list[Sample], drop: bool) -> tuple[list[Sample], int]:
    """Keep (and count) or drop the samples without a supervised label; refuse a batch of them."""
    bad = [s.index for s in samples if not is_supervised(s)]
    if len(bad) == len(samples):
        shown = f"{bad[:20]}{'...' if len(bad) > 20 else ''}"
        raise ValueError(
            f"rope_collate_fn: all {len(samples)} samples of the batch have no "
            f"supervised label (indices {shown}): the mean loss would be 0/0 = NaN. "
            "A label counts when it is != -100 after a document's first token "
            "(the causal shift never uses that one). Check the dataset label "
            "masking and filter such samples (1-token samples, replies truncated "
            "away) out of the dataset."
        )
    if not bad or not drop:
        return samples, len(bad)
    warnings.warn(
        f"rope_collate_fn: dropped {len(bad)} of {len(samples)} samples with no "
        f"supervised label (batch indices {bad}).",
        stacklevel=3,
    )
    dropped = set(bad)
    return [s for s in samples if s.index not in dropped], 0


def _check_options(pad_index: object, flags: dict, ints: dict, pack: bool) -> None:
    """Types and ranges of the collate options; ``ints`` maps name -> (value, lowest)."""
    if not isinstance(pad_index, Integral) or isinstance(pad_index, bool):
        raise TypeError(
            f"rope_collate_fn: option pad_index: expected an int token id >= 0, got "
            f"{show(pad_index)}. Pass the tokenizer's pad_token_id (XTuner's "
            "default: 0)."
        )
    if pad_index < 0:
        raise ValueError(
            f"rope_collate_fn: option pad_index: expected an int token id >= 0 (a "
            f"row of the embedding), got {pad_index}. Pass the tokenizer's "
            "pad_token_id (XTuner's default: 0)."
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(
                f"rope_collate_fn: option {name}: expected True or False, got {show(value)}."
            )
    for name, (value, low) in ints.items():
        if value is None:
            continue
        if not isinstance(value, Integral) or isinstance(value, bool):
            raise TypeError(
                f"rope_collate_fn: option {name}: expected None or an int >= {low}, "
                f"got {show(value)}."
            )
        if value < low:
            raise ValueError(
                f"rope_collate_fn: option {name}: expected None or an int >= {low}, got {value!r}."
            )
    if pack and ints["max_length"][0] is None:
        raise ValueError(
            "rope_collate_fn: option max_length: expected an int when pack=True, "
            "got None. Set collate_fn=dict(..., pack=True, "
            "max_length=<tokens per row>)."
        )


def _check_lengths(samples: list[Sample], max_length: int | None) -> None:
    if max_length is None:
        return
    for s in samples:
        if s.input_ids.numel() > max_length:
            raise item_error(
                s.index,
                "input_ids",
                f"at most max_length={max_length} tokens",
                s.input_ids.numel(),
                "Truncate in the dataset (process_hf_dataset("
                "max_length=...)) or raise the collate max_length.",
            )


def _assemble_row(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate samples into one unpadded row: ``[L]`` ids, ``[L]`` labels, boundaries."""
    ids = torch.cat([s.input_ids for s in samples])
    labels = torch.cat([s.labels for s in samples])  # cat copies: the items stay untouched
    cu = cumulative_from_lengths(torch.cat([lengths_from_cumulative(s.cu) for s in samples]))
    # A document's first label would be predicted from the previous document's last
    # token by the causal shift; ignore it so a row's loss is the sum of its documents'.
    labels[cu[1:-1].long()] = IGNORE_INDEX
    return ids, labels, cu


def _padding_boundaries(n: int, s: int, longest: int) -> torch.Tensor:
    """Boundaries of a row's padding ``[n, s)`` in segments shorter than ``longest`` (the batch's
    longest document), so padding never leaves the RoPE range."""
    cap = max(longest - 1, 1)
    return torch.tensor([*range(n + cap, s, cap), s], dtype=torch.int32)


def _pad_rows(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], s: int, pad_index: int
) -> dict:
    b = len(rows)
    input_ids = torch.full((b, s), pad_index, dtype=torch.long)
    labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long)
    longest = max(int(lengths_from_cumulative(cu).max()) for _, _, cu in rows)
    cumulative_len = []
    for r, (ids, lab, cu) in enumerate(rows):
        n = ids.numel()
        input_ids[r, :n], labels[r, :n] = ids, lab
        # Padding is segments of its own: positions 0, 1, ... and attended only by itself.
        cumulative_len.append(cu if n == s else torch.cat([cu, _padding_boundaries(n, s, longest)]))
    position_ids = position_ids_from_starts(segment_starts_from_cumulative(cumulative_len, s))
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cumulative_len": cumulative_len,
        "max_seqlen": int(position_ids.max()) + 1,
    }


def rope_collate_fn(
    instances: Sequence[Mapping],
    pad_index: int = DEFAULT_PAD_TOKEN_INDEX,
    *,
    use_varlen_attn: bool = False,
    pack: bool = False,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
    min_length: int | None = None,
    return_hf_format: bool = False,
    drop_unsupervised: bool = False,
) -> dict:
    """Collate XTuner items into a batch whose rows carry document boundaries.

    Position ids restart at 0 per document; the padding is a segment of its own. Samples
    without a supervised label are counted (``num_unsupervised``) or dropped.

    Args:
        instances: ``b`` items; ``input_ids``/``labels`` as lists or 1-D integer tensors, plain
            or XTuner-packed (``cumulative_len`` and/or ``position_ids``).
        pad_index: token id used for padding (an int >= 0).
        use_varlen_attn: accepted for XTuner configs; boundaries are always returned.
        pack: pack the items by best-fit decreasing into rows of at most ``max_length``.
        max_length: row capacity when packing; otherwise an upper bound on item length.
        pad_to_multiple_of: round ``s`` up to a multiple of this; min_length: at least this.
        return_hf_format: return the inner dict instead of ``{'data': ..., 'data_samples': None}``.
        drop_unsupervised: drop items with no supervised label (one warning with the count).

    Returns:
        ``input_ids``, ``labels`` (-100 on padding and each document's first token),
        ``position_ids`` ``[b, s]``, ``cumulative_len`` (``b`` int32 ``[0, ..., s]``),
        ``max_seqlen``, ``num_unsupervised`` and, for unpacked plain items, ``attention_mask``
        ``[b, s]`` bool.

    Raises:
        ValueError: an empty batch or sample, mismatched lengths, bad ids, labels or
            boundaries, a sample over ``max_length``, no supervised label, an option out of range.
        TypeError: an item that is not a dict, ids that are not ints, an option's type.
    """
    del use_varlen_attn  # boundaries are always returned; kept for XTuner configs
    _check_options(
        pad_index,
        {
            "pack": pack,
            "return_hf_format": return_hf_format,
            "drop_unsupervised": drop_unsupervised,
        },
        {
            "max_length": (max_length, 1),
            "pad_to_multiple_of": (pad_to_multiple_of, 1),
            "min_length": (min_length, 0),
        },
        pack,
    )
    if isinstance(instances, (str, bytes, Mapping)) or not isinstance(instances, Sequence):
        raise TypeError(
            f"rope_collate_fn: expected a list of samples (dicts), got "
            f"{show(instances)}. Use it as the DataLoader collate_fn."
        )
    if len(instances) == 0:
        raise ValueError("rope_collate_fn: got an empty batch (0 samples); check the sampler.")
    samples = [parse_sample(i, item) for i, item in enumerate(instances)]
    check_id_range(samples)
    _check_lengths(samples, max_length)
    samples, unsupervised = _apply_policy(samples, drop_unsupervised)
    if pack:
        plan = plan_packs([s.input_ids.numel() for s in samples], max_length)
    else:
        plan = [[i] for i in range(len(samples))]
    rows = [_assemble_row([samples[i] for i in row]) for row in plan]
    s = padded_length(
        max(ids.numel() for ids, _, _ in rows),
        pad_to_multiple_of=pad_to_multiple_of,
        min_length=min_length,
    )
    data = _pad_rows(rows, s, int(pad_index))
    data["num_unsupervised"] = unsupervised
    if not pack and not any(smp.carries_boundaries for smp in samples):
        lengths = torch.tensor([ids.numel() for ids, _, _ in rows])
        data["attention_mask"] = torch.arange(s).expand(len(rows), s) < lengths[:, None]
    return data if return_hf_format else {"data": data, "data_samples": None}
