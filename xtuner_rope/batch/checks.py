"""Cheap CPU checks of a collated batch, so bad input fails with a clear message, not in a CUDA
kernel."""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Integral

import torch

from xtuner_rope.ops.boundaries import check_flat_boundaries
from xtuner_rope.ops.inputs import show, to_int_tensor
from xtuner_rope.ops.packing import position_ids_from_starts, segment_starts_from_cumulative

from .items import IGNORE_INDEX

__all__ = ["batch_data", "check_packed_batch", "check_flat_boundaries", "row_boundaries"]


def _fail(
    field: str,
    expected: str,
    got: object,
    fix: str,
    row: int | None = None,
    document: int | None = None,
) -> ValueError:
    where = (
        ""
        if row is None
        else f"row {row}, " + ("" if document is None else f"document {document}, ")
    )
    return ValueError(
        f"check_packed_batch: {where}field {field!r}: expected {expected}, got {got}. {fix}"
    )


def _tensor(
    data: Mapping,
    field: str,
    shape: tuple[int, ...] | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.int64,),
) -> torch.Tensor:
    """Fetch ``data[field]`` and check it is a tensor of an allowed dtype and shape."""
    value = data[field]
    if not isinstance(value, torch.Tensor) or value.dtype not in dtypes:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(
            f"check_packed_batch: field {field!r}: expected a tensor of dtype "
            f"{' or '.join(map(str, dtypes))}, got {got}. Build the batch with "
            "rope_collate_fn (or torch.long ids)."
        )
    if shape is None and (value.dim() != 2 or 0 in value.shape):
        raise _fail(
            field,
            "a non-empty [b, s] tensor",
            f"shape {list(value.shape)}",
            "Collate items into a 2-D batch.",
        )
    if shape is not None and tuple(value.shape) != shape:
        raise _fail(
            field,
            f"shape {list(shape)} like input_ids",
            f"{list(value.shape)}",
            "Collate all fields together.",
        )
    return value


def batch_data(data_batch: object, who: str) -> Mapping:
    """The inner ``data`` dict of an XTuner batch (``who``: the caller, for the message).

    Raises:
        TypeError: the batch is not a dict, or its ``data`` field is not one.
    """
    fix = "Collate with rope_collate_fn or XTuner's default_collate_fn."
    if not isinstance(data_batch, Mapping):
        raise TypeError(
            f"{who}: expected an XTuner batch {{'data': {{...}}, 'data_samples': "
            f"...}}, got {show(data_batch)}. {fix}"
        )
    data = data_batch.get("data")
    if not isinstance(data, Mapping):
        got = f"keys {sorted(map(str, data_batch))}" if "data" not in data_batch else show(data)
        raise TypeError(
            f"{who}: field 'data' of the batch: expected a dict of tensors "
            f"(input_ids, labels, ...), got {got}. {fix}"
        )
    return data


def row_boundaries(data: Mapping, b: int) -> list[torch.Tensor]:
    """``cumulative_len`` of ``data`` as ``b`` 1-D integer tensors (from a list, a ``[b, k]``
    tensor, or for ``b == 1`` XTuner's bare ``[k]`` tensor).

    Raises:
        ValueError: not one 1-D boundary tensor per row; TypeError: non-integer boundaries.
    """
    cus = data["cumulative_len"]
    fix = "Give one 1-D integer cumulative_len tensor per row (rope_collate_fn does)."
    if isinstance(cus, torch.Tensor):
        if cus.dim() > 2:
            raise _fail(
                "cumulative_len",
                "a list of 1-D tensors, or a [b, k] tensor",
                f"shape {list(cus.shape)}",
                fix,
            )
        cus = [cus.reshape(-1)] if cus.dim() <= 1 or b == 1 else list(cus.unbind(0))
    elif not isinstance(cus, (list, tuple)):
        raise TypeError(
            f"check_packed_batch: field 'cumulative_len': expected a list of "
            f"tensors, got {show(cus)}. {fix}"
        )
    if len(cus) != b:
        raise _fail(
            "cumulative_len",
            f"one boundary tensor per row ({b})",
            len(cus),
            "Return a list with one cumulative_len tensor per row.",
        )
    out = []
    for r, cu in enumerate(cus):
        where = f"check_packed_batch: row {r}, field 'cumulative_len'"
        cu = to_int_tensor(cu, where, "Use an integer tensor (int32 for flash-attn).")
        if cu.dim() > 1 and cu.shape[0] != 1 or cu.dim() > 2:
            raise _fail("cumulative_len", "a 1-D tensor per row", f"shape {list(cu.shape)}", fix, r)
        out.append(cu.reshape(-1))
    return out


def _check_boundaries(cus: list[torch.Tensor], s: int) -> None:
    """Each row's boundaries start at 0, strictly increase and end at ``s``; vectorised."""
    fix = "Rebuild the boundaries with xtuner_rope.ops.packing.cumulative_from_lengths."
    counts = torch.tensor([cu.numel() for cu in cus])
    if bool((counts < 2).any()):
        r = int((counts < 2).nonzero()[0])
        raise _fail("cumulative_len", "at least 2 boundaries [0, ..., s]", cus[r].tolist(), fix, r)
    flat = torch.cat(cus).long()
    rows = torch.repeat_interleave(torch.arange(len(cus)), counts)
    firsts = counts.cumsum(0) - counts
    for name, idx, want in (("start at 0", firsts, 0), (f"end at s={s}", firsts + counts - 1, s)):
        bad = flat[idx] != want
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            raise _fail("cumulative_len", f"boundaries that {name}", cus[r].tolist(), fix, r)
    bad = (flat[1:] <= flat[:-1]) & (rows[1:] == rows[:-1])
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        r = int(rows[k])
        d = k - int(firsts[r])
        raise _fail(
            "cumulative_len",
            "strictly increasing boundaries (no empty document)",
            f"cumulative_len[{d}:{d + 2}] = {flat[k : k + 2].tolist()}",
            fix,
            r,
            d,
        )


def _locate(starts: torch.Tensor, bad: torch.Tensor) -> tuple[int, int, int]:
    """Row, document and column of the first True in ``bad`` (``[b, s]``)."""
    r, c = (int(v) for v in bad.nonzero()[0])
    return r, int(starts[r, : c + 1].sum()) - 1, c


def _check_positions(
    data: Mapping, starts: torch.Tensor, shape: tuple[int, int], max_position: int | None
) -> torch.Tensor:
    """Position ids must restart at 0 at each boundary and count +1 within; returns them."""
    expected = position_ids_from_starts(starts)
    if data.get("position_ids") is not None:
        got = _tensor(data, "position_ids", shape)
        bad = got != expected
        if bool(bad.any()):
            r, d, c = _locate(starts, bad)
            raise _fail(
                "position_ids",
                f"{int(expected[r, c])} at column {c} (0 at each document start, +1 within)",
                int(got[r, c]),
                "Derive position_ids from cumulative_len (rope_collate_fn does).",
                r,
                d,
            )
    longest = int(expected.max()) + 1
    max_seqlen = data.get("max_seqlen")
    if max_seqlen is not None and not (
        isinstance(max_seqlen, Integral)
        and not isinstance(max_seqlen, bool)
        or isinstance(max_seqlen, torch.Tensor)
        and max_seqlen.numel() == 1
        and not max_seqlen.dtype.is_floating_point
    ):
        raise TypeError(
            f"check_packed_batch: field 'max_seqlen': expected an int, got "
            f"{show(max_seqlen)}. Recompute max_seqlen from cumulative_len."
        )
    if max_seqlen is not None and int(max_seqlen) != longest:
        raise _fail(
            "max_seqlen",
            f"the longest segment, {longest}",
            int(data["max_seqlen"]),
            "Recompute max_seqlen from cumulative_len.",
        )
    if max_position is not None and longest > max_position:
        r, d, c = _locate(starts, expected == longest - 1)
        raise _fail(
            "position_ids",
            f"positions < max_position={max_position} (the RoPE range)",
            longest - 1,
            "Lower max_length, or raise max_position_embeddings / use RoPE scaling.",
            r,
            d,
        )
    return expected


def _check_ids(
    starts: torch.Tensor, field: str, values: torch.Tensor, vocab_size: int | None, ignore: bool
) -> None:
    """Token ids in ``[0, vocab_size)``; labels may also be IGNORE_INDEX."""
    bad = values < 0 if vocab_size is None else (values < 0) | (values >= vocab_size)
    if ignore:
        bad &= values != IGNORE_INDEX
    if bool(bad.any()):
        r, d, c = _locate(starts, bad)
        span = ">= 0" if vocab_size is None else f"in [0, {vocab_size})"
        extra = f" or {IGNORE_INDEX}" if ignore else ""
        raise _fail(
            field,
            f"ids {span}{extra} (column {c})",
            int(values[r, c]),
            "Check the tokenizer matches the model (vocab_size) and the label masking.",
            r,
            d,
        )


def _check_attention_mask(data: Mapping, shape: tuple[int, int]) -> None:
    mask = _tensor(data, "attention_mask", shape, (torch.bool, torch.int64, torch.int32))
    empty = ~mask.bool().any(dim=1)
    if bool(empty.any()):
        r = int(empty.nonzero()[0])
        raise _fail(
            "attention_mask",
            "at least one attended token per row",
            "none",
            "Drop empty samples; an all-masked row gives NaN attention.",
            r,
        )


def _check_supervised(data: Mapping, labels: torch.Tensor) -> None:
    """Some label after column 0 (the shift never uses column 0's): else the loss is 0/0."""
    count = data.get("num_unsupervised")
    if count is not None and (
        not isinstance(count, Integral) or isinstance(count, bool) or count < 0
    ):
        raise TypeError(
            f"check_packed_batch: field 'num_unsupervised': expected an int >= 0 "
            f"(samples without a supervised label), got {show(count)}."
        )
    if not bool((labels[:, 1:] != IGNORE_INDEX).any()):
        rows = list(range(labels.shape[0]))
        raise _fail(
            "labels",
            "at least one supervised label (!= -100) after column 0",
            "none "
            f"in rows {rows[:20]}{'...' if len(rows) > 20 else ''} (the mean loss would "
            "be 0/0 = NaN)",
            "Check the label masking, and filter samples without a "
            "supervised token out of the dataset (rope_collate_fn refuses such batches "
            "and counts them as num_unsupervised).",
        )


def check_packed_batch(
    data: Mapping, *, vocab_size: int | None = None, max_position: int | None = None
) -> None:
    """Check a collated batch (the inner ``data`` dict) before it reaches the model.

    Boundaries run 0 .. ``s`` strictly increasing; positions restart at 0 per document and stay
    below ``max_position``; ids and labels lie in ``[0, vocab_size)`` (labels may be -100); every
    mask row attends to something; some label after column 0 is supervised.

    Args:
        data: ``input_ids``, ``labels`` ``[b, s]`` int64, optional ``position_ids``,
            ``cumulative_len``, ``max_seqlen``, ``attention_mask``, ``num_unsupervised``.
        vocab_size, max_position: Upper bounds, None: unchecked.

    Raises:
        ValueError: a check fails; the message names row, document, field, expected and got.
        TypeError: a field has the wrong type or dtype.
    """
    if not isinstance(data, Mapping):
        raise TypeError(
            f'check_packed_batch: expected the batch dict (batch["data"]), got {show(data)}.'
        )
    for field in ("input_ids", "labels"):
        if field not in data:
            raise _fail(
                field,
                "a batch dict with input_ids and labels",
                f"keys {sorted(data)}",
                'Pass the inner data dict (batch["data"]).',
            )
    input_ids = _tensor(data, "input_ids")
    shape = tuple(input_ids.shape)
    labels = _tensor(data, "labels", shape)
    if data.get("cumulative_len") is not None:
        cus = row_boundaries(data, shape[0])
        _check_boundaries(cus, shape[1])
        starts = segment_starts_from_cumulative(cus, shape[1])
    elif data.get("position_ids") is not None:
        starts = _tensor(data, "position_ids", shape) == 0
    else:  # plain HF batch: one segment per row, positions 0..s-1
        starts = torch.zeros(shape, dtype=torch.bool)
    starts[:, 0] = True
    _check_positions(data, starts, shape, max_position)
    _check_ids(starts, "input_ids", input_ids, vocab_size, ignore=False)
    _check_ids(starts, "labels", labels, vocab_size, ignore=True)
    if data.get("attention_mask") is not None:
        _check_attention_mask(data, shape)
    _check_supervised(data, labels)
