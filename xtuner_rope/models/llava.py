"""XTuner's LLaVA models: the sequence the LLM sees after the image expansion, checked.

xtuner 0.2.0's ``prepare_inputs_labels_for_multimodal`` replaces each image placeholder by its
patch embeddings and right-pads again; :func:`check_expanded_batch` checks the result
(``compat.xtuner_llava.patch_llava_expansion_check``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from xtuner_rope.batch.image_packing import expand_row_boundaries
from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX
from xtuner_rope.batch.items import IGNORE_INDEX
from xtuner_rope.ops.document_plan import host_to_device
from xtuner_rope.ops.host_copies import host_copy, remember_host_copy
from xtuner_rope.ops.packing import (
    cumulative_from_lengths,
    flat_cumulative,
    position_ids_from_starts,
    segment_starts_from_cumulative,
)

from . import channel
from .runtime import hub_cumulative_len


def _fail(row: int, field: str, expected: str, got: object, fix: str) -> ValueError:
    return ValueError(
        f"check_expanded_batch (after the image expansion): row {row}, field "
        f"{field!r}: expected {expected}, got {got}. {fix}"
    )


def _host_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """The host copies of the ids and bool mask ``[b, s]`` before the expansion, or None."""
    ids = host_copy(input_ids)
    mask = None if attention_mask is None else host_copy(attention_mask)
    if ids is None or (attention_mask is not None and mask is None):
        return None
    mask = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    return ids, mask


def expanded_row_lengths(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, image_tokens: int
) -> torch.Tensor | None:
    """Each row's length ``n - k + k * P`` after the image expansion ``[b]``, from the host
    copies of the batch; None without them (the check then reads the expanded batch back)."""
    host = _host_batch(input_ids, attention_mask)
    if host is None:
        return None
    ids, mask = host
    images = ((ids == IMAGE_TOKEN_INDEX) & mask).sum(dim=1)  # [b]
    return mask.sum(dim=1) + images * (image_tokens - 1)


def check_expanded_batch(
    out: Mapping, max_position: int | None = None, lengths: torch.Tensor | None = None
) -> None:
    """Check XTuner's expanded LLaVA batch, as the LLM will see it.

    Args:
        out: ``prepare_inputs_labels_for_multimodal``'s result: ``inputs_embeds``
            ``[b, s, d]``, optional ``attention_mask`` / ``position_ids`` / ``labels``
            ``[b, s]``.
        max_position: The RoPE range positions must stay below (None: unchecked).
        lengths: ``[b]`` expanded lengths from :func:`expanded_row_lengths` (no device read);
            None: measured on ``out``, and the rebuilt positions checked too.

    Raises:
        ValueError: a row attends to nothing, its positions do not count 0, 1, ... over its
            real tokens, or they leave the RoPE range (image patches count).
    """
    embeds = out["inputs_embeds"]
    b, s = embeds.shape[:2]
    mask = out.get("attention_mask")
    on_host = lengths is not None
    if not on_host:
        lengths = (
            mask.bool().sum(dim=1) if mask is not None else torch.full((b,), s, dtype=torch.long)
        )
    empty = (lengths == 0).nonzero()
    if len(empty):
        raise _fail(
            int(empty[0]),
            "attention_mask",
            "at least one attended token",
            "none",
            "Drop empty samples: an all-masked row gives NaN attention.",
        )
    positions = out.get("position_ids")
    if positions is not None and not on_host:
        _check_rebuilt_positions(positions, lengths, b, s)
    longest = int(lengths.max())
    if max_position is not None and longest > max_position:
        r = int(lengths.argmax())
        raise _fail(
            r,
            "position_ids",
            f"positions < max_position={max_position} (the RoPE range)",
            f"{longest} tokens after the images were expanded into patch embeddings",
            "Lower max_length (it counts each image as one token), use "
            "fewer images per sample, or raise max_position_embeddings.",
        )


def expanded_labels(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    image_tokens: int,
    width: int,
) -> torch.Tensor:
    """XTuner's expanded labels ``[b, width]`` on the host: attended labels, ``P`` times -100
    per placeholder, right-padded with -100 (xtuner 0.2.0).

    Args:
        input_ids: ``[b, s]`` host ids before the expansion; attention_mask: ``[b, s]`` bool.
        labels: ``[b, s]`` host labels before the expansion.
        image_tokens: ``P``, patch embeddings per image; width: ``s'``, the expanded width.
    """
    out = torch.full((input_ids.shape[0], width), IGNORE_INDEX, dtype=labels.dtype)
    for r, (ids, mask, row) in enumerate(zip(input_ids, attention_mask, labels)):
        image = ids[mask] == IMAGE_TOKEN_INDEX  # [n]
        counts = torch.where(image, image_tokens, 1)  # [n]: P tokens for a placeholder
        row = row[mask].masked_fill(image, IGNORE_INDEX).repeat_interleave(counts)  # [n']
        out[r, : row.numel()] = row
    return out


def remember_expanded_host_copies(
    out: Mapping, lengths: torch.Tensor, before: Mapping, image_tokens: int
) -> None:
    """Remember host copies of XTuner's rebuilt ``attention_mask``, ``position_ids`` (True and
    ``0..n-1`` over a row's ``n`` tokens, then False and 0) and ``labels``, built from the host
    ``lengths`` and ``before`` (the expansion's arguments); compared with XTuner's on the CPU.
    """
    s_out = out["inputs_embeds"].shape[1]
    columns = torch.arange(s_out)[None]  # [1, s']
    real = columns < lengths[:, None]  # [b, s']
    hosts = [("attention_mask", real), ("position_ids", columns * real)]
    batch = _host_batch(before["input_ids"], before.get("attention_mask"))
    labels = before.get("labels")
    labels = None if labels is None else host_copy(labels)
    if batch is not None and labels is not None:
        hosts.append(("labels", expanded_labels(*batch, labels, image_tokens, s_out)))
    for key, host in hosts:
        device = out.get(key)
        if device is None:
            continue
        host = host.to(device.dtype)
        if device.device.type == "cpu":  # an internal invariant, checked where it costs nothing
            assert torch.equal(device, host), f"XTuner's expanded {key} differs from ours"
        remember_host_copy(device, host)


def _check_rebuilt_positions(positions: torch.Tensor, lengths: torch.Tensor, b: int, s: int):
    """XTuner's rebuilt positions count ``0..n-1`` over each row's ``lengths`` real tokens."""
    expected = torch.arange(s, device=positions.device).expand(b, s)
    real = expected < lengths.to(positions.device)[:, None]
    bad = (positions != expected) & real
    if bool(bad.any()):
        r, c = (int(v) for v in bad.nonzero()[0])
        raise _fail(
            r,
            "position_ids",
            f"{c} at column {c} (0..n-1 over the row's tokens)",
            int(positions[r, c]),
            "Report this: XTuner's expansion rebuilds them.",
        )


def flat_row_bounds(flat: torch.Tensor, b: int, s: int) -> list[torch.Tensor]:
    """Per-row ``[n_r + 1]`` boundaries ``0 .. s`` of flat ``[n + 1]`` ones over ``b * s``."""
    flat = torch.as_tensor(flat)
    host = host_copy(flat)
    flat = (flat.cpu() if host is None else host).reshape(-1).long()
    return [flat[(flat >= r * s) & (flat <= (r + 1) * s)] - r * s for r in range(b)]


def restart_after_expansion(
    out: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_tokens: int
) -> dict:
    """Packed LLaVA rows: boundaries and positions of the expanded sequence, published.

    The collate's published boundaries are measured again after the expansion (padding a
    segment of its own) and replace them; positions restart at 0 per sample. Without
    published boundaries (padded rows) ``out`` is returned unchanged.

    Args:
        out: The expansion's result (``inputs_embeds`` ``[b, s', d]``, ``attention_mask``,
            ``position_ids``, ``labels`` ``[b, s']``); ``position_ids`` is replaced.
        input_ids: ``[b, s]`` the ids before the expansion; attention_mask: ``[b, s]``.
        image_tokens: ``P``, patch embeddings per image.

    Raises:
        ValueError: the expanded lengths disagree with the rows XTuner built.
    """
    published = hub_cumulative_len()
    if published is None or out.get("inputs_embeds") is None:
        return out
    b, s = input_ids.shape
    s_out = out["inputs_embeds"].shape[1]
    host = _host_batch(input_ids, attention_mask)
    if host is None:  # device tensors without host copies: read back once
        mask = torch.ones(b, s, dtype=torch.bool) if attention_mask is None else attention_mask
        host = input_ids.cpu(), mask.bool().cpu()
    ids, mask = host
    cus, expanded = [], []
    for r, cu in enumerate(flat_row_bounds(published, b, s)):
        lengths = expand_row_boundaries(ids[r], mask[r], cu, image_tokens)
        expanded.append(lengths)
        n = sum(lengths)
        cus.append(cumulative_from_lengths(lengths + ([s_out - n] if n < s_out else [])))
    _check_expanded_width([sum(lengths) for lengths in expanded], expanded, s_out)
    device = out["inputs_embeds"].device
    positions = position_ids_from_starts(segment_starts_from_cumulative(cus, s_out))
    channel.publish(flat_cumulative(cus, s_out), int(positions.max()) + 1)  # host: no sync
    moved = host_to_device(positions, device)
    remember_host_copy(moved, positions)
    return {**out, "position_ids": moved}


def _check_expanded_width(totals: list[int], segments: list[list[int]], s_out: int) -> None:
    """The host-measured row lengths fit ``s_out`` and the longest fills it (XTuner pads to it)."""
    longest = max(range(len(totals)), key=totals.__getitem__)
    for r, n in enumerate(totals):
        if n > s_out or (r == longest and n != s_out):
            raise _fail(
                r,
                "cumulative_len",
                f"{n} tokens after the expansion (segments {segments[r]})",
                f"{s_out} in XTuner's expanded row",
                "Collate LLaVA samples with xtuner_rope.llava_collate_fn.",
            )
