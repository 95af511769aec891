"""XTuner's LLaVA models: the sequence the LLM sees after the image expansion, checked.

``LLaVAModel.forward`` (xtuner 0.2.0) runs the CLIP tower and the projector, then
``prepare_inputs_labels_for_multimodal`` replaces each image placeholder by the image's patch
embeddings, drops the padding and pads again on the right: ``inputs_embeds`` ``[b, s', d]``
with ``s'`` the longest expanded row, ``attention_mask`` True over each row's real tokens,
``position_ids`` ``0..n_r-1`` per row, ``labels`` -100 on image tokens and padding. The LLM's
attention and RoPE are the family's (patched as in text SFT); :func:`check_expanded_batch`
checks that sequence (``xtuner_rope.compat.xtuner_llava.patch_llava_expansion_check`` calls it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from xtuner_rope.batch.image_packing import expand_row_boundaries
from xtuner_rope.ops.packing import (
    cumulative_from_lengths,
    flat_cumulative,
    position_ids_from_starts,
    segment_starts_from_cumulative,
)

from . import channel
from .runtime import hub_cumulative_len

IGNORE_INDEX = -100


def _fail(row: int, field: str, expected: str, got: object, fix: str) -> ValueError:
    return ValueError(
        f"check_expanded_batch (after the image expansion): row {row}, field "
        f"{field!r}: expected {expected}, got {got}. {fix}"
    )


def check_expanded_batch(out: Mapping, max_position: int | None = None) -> None:
    """Check XTuner's expanded LLaVA batch, as the LLM will see it.

    Args:
        out: ``prepare_inputs_labels_for_multimodal``'s result: ``inputs_embeds``
            ``[b, s, d]``, optional ``attention_mask`` / ``position_ids`` / ``labels``
            ``[b, s]``.
        max_position: The RoPE range positions must stay below (None: unchecked).

    Raises:
        ValueError: a row attends to nothing, its positions do not count 0, 1, ... over its
            real tokens, or they leave the RoPE range (image tokens count: each placeholder
            became the image's patch embeddings); the message names row and field.
    """
    embeds = out["inputs_embeds"]
    b, s = embeds.shape[:2]
    mask = out.get("attention_mask")
    lengths = mask.bool().sum(dim=1) if mask is not None else torch.full((b,), s, dtype=torch.long)
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
    if positions is not None:
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


def _row_boundaries(flat: torch.Tensor, b: int, s: int) -> list[torch.Tensor]:
    """Per-row boundaries ``0 .. s`` of a flat ``[n + 1]`` boundary tensor over ``b * s``."""
    flat = torch.as_tensor(flat).reshape(-1).long().cpu()
    return [flat[(flat >= r * s) & (flat <= (r + 1) * s)] - r * s for r in range(b)]


def restart_after_expansion(
    out: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_tokens: int
) -> dict:
    """Packed LLaVA rows: boundaries and positions of the expanded sequence, published.

    ``PackedBatchCheckHook`` publishes the collate's boundaries (``cumulative_len`` before the
    expansion) in ``MessageHub``; XTuner's expansion then makes each row longer and numbers it
    ``0..n-1`` as one sequence. Here each segment is measured after the expansion
    (``batch.image_packing.expand_row_boundaries``), the positions restart at 0 per sample
    and the expanded boundaries (padding a segment of its own) replace the published ones, so
    the patched attention isolates the samples the LLM really sees. Without published
    boundaries (XTuner's padded rows) ``out`` is returned unchanged.

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
    mask = (
        attention_mask.bool().cpu()
        if attention_mask is not None
        else torch.ones(b, s, dtype=torch.bool)
    )
    ids = input_ids.cpu()
    cus = []
    for r, cu in enumerate(_row_boundaries(published, b, s)):
        lengths = expand_row_boundaries(ids[r], mask[r], cu, image_tokens)
        n = sum(lengths)
        got = (
            int(out["attention_mask"][r].sum()) if out.get("attention_mask") is not None else s_out
        )
        if n != got:
            raise _fail(
                r,
                "cumulative_len",
                f"{n} tokens after the expansion (segments {lengths})",
                f"{got} in XTuner's expanded row",
                "Collate LLaVA samples with xtuner_rope.llava_collate_fn.",
            )
        cus.append(cumulative_from_lengths(lengths + ([s_out - n] if n < s_out else [])))
    device = out["inputs_embeds"].device
    positions = position_ids_from_starts(segment_starts_from_cumulative(cus, s_out))
    channel.publish(flat_cumulative(cus, s_out), int(positions.max()) + 1)
    return {**out, "position_ids": positions.to(device)}
