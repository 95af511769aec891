"""XTuner's LLaVA models: the sequence the LLM sees after the image expansion, checked.

``LLaVAModel.forward`` (xtuner 0.2.0) runs the CLIP tower and the projector, then
``prepare_inputs_labels_for_multimodal`` replaces each image placeholder by the image's patch
embeddings, drops the padding and pads again on the right: ``inputs_embeds`` ``[b, s', d]``
with ``s'`` the longest expanded row, ``attention_mask`` True over each row's real tokens,
``position_ids`` ``0..n_r-1`` per row, ``labels`` -100 on image tokens and padding. The LLM's
attention and RoPE are the family's (patched as in text SFT); :func:`check_expanded_batch`
checks that sequence (``xtuner_rope.compat.patch_llava_expansion_check`` calls it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

IGNORE_INDEX = -100


def _fail(row: int, field: str, expected: str, got: object, fix: str) -> ValueError:
    return ValueError(f"check_expanded_batch (after the image expansion): row {row}, field "
                      f"{field!r}: expected {expected}, got {got}. {fix}")


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
    lengths = (mask.bool().sum(dim=1) if mask is not None
               else torch.full((b,), s, dtype=torch.long))
    empty = (lengths == 0).nonzero()
    if len(empty):
        raise _fail(int(empty[0]), "attention_mask", "at least one attended token", "none",
                    "Drop empty samples: an all-masked row gives NaN attention.")
    positions = out.get("position_ids")
    if positions is not None:
        expected = torch.arange(s, device=positions.device).expand(b, s)
        real = expected < lengths.to(positions.device)[:, None]
        bad = (positions != expected) & real
        if bool(bad.any()):
            r, c = (int(v) for v in bad.nonzero()[0])
            raise _fail(r, "position_ids", f"{c} at column {c} (0..n-1 over the row's tokens)",
                        int(positions[r, c]), "Report this: XTuner's expansion rebuilds them.")
    longest = int(lengths.max())
    if max_position is not None and longest > max_position:
        r = int(lengths.argmax())
        raise _fail(r, "position_ids", f"positions < max_position={max_position} (the RoPE "
                    "range)", f"{longest} tokens after the images were expanded into patch "
                    "embeddings", "Lower max_length (it counts each image as one token), use "
                    "fewer images per sample, or raise max_position_embeddings.")
