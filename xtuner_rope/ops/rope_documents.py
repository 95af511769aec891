"""Per-document RoPE frequencies for packed rows: each document gets what it gets alone.

Dynamic NTK and LongRoPE choose frequencies from the length served, upstream once per call from
the row's largest position; here each token gets those of its document's length. Torch only:
``models.hf_rope`` and ``models.internlm2_rope`` say where the documents are.
"""

from __future__ import annotations

from typing import Callable

import torch

from xtuner_rope.ops.document_plan import host_to_device

__all__ = ["document_lengths", "host_document_lengths", "per_token_inv_freq"]


def document_lengths(position_ids: torch.Tensor, cu_seqlens: torch.Tensor, b: int, s: int):
    """Each token's document length (its last position + 1), ``[b, s]`` int64 on ``position_ids``'
    device, from ``position_ids`` ``[b, s]`` or ``[1, s]`` and the flat ``cu_seqlens``
    ``[n_docs + 1]`` over the ``[b * s]`` tokens of ``b`` rows of ``s``.
    """
    flat = position_ids.expand(b, s).reshape(-1)  # [t]
    cu = cu_seqlens.to(flat.device, torch.int64)
    lengths = flat[cu[1:] - 1] + 1  # [n_docs] last position + 1
    return torch.repeat_interleave(lengths, cu[1:] - cu[:-1]).view(b, s)  # [b, s]


def host_document_lengths(cu_seqlens: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """Each token's document length ``[b, s]`` int64 on the CPU, from the ``[n_docs + 1]`` flat host
    boundaries ``cu_seqlens`` (positions counting from 0 per document, as the collate function's).
    """
    cu = cu_seqlens.to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]  # [n_docs]
    return torch.repeat_interleave(lengths, lengths).view(b, s)  # [b, s]


def per_token_inv_freq(
    lengths: torch.Tensor,
    base_inv_freq: torch.Tensor,
    threshold: int,
    inv_freq_of: Callable[[int], torch.Tensor],
    device: torch.device | None = None,
) -> torch.Tensor:
    """fp32 inverse frequencies of each token's document, ``[b, s, h_d/2]`` on ``device``.

    Documents up to ``threshold`` tokens keep ``base_inv_freq``; each longer length gets
    ``inv_freq_of(length)`` (once per distinct length).

    Args:
        lengths: ``[b, s]`` document length of every token (see :func:`document_lengths`).
        base_inv_freq: ``[h_d/2]`` fp32 frequencies of the short documents.
        threshold: The longest length that keeps ``base_inv_freq``.
        inv_freq_of: Length -> ``[h_d/2]`` fp32 frequencies upstream uses for that length.
        device: Where the result goes (default: ``lengths``' device; CPU lengths are grouped
            without a device sync).
    """
    device = lengths.device if device is None else torch.device(device)
    distinct, index = torch.unique(lengths, return_inverse=True)  # [n_distinct], [b, s]
    rows = [
        base_inv_freq if n <= threshold else inv_freq_of(n).to(base_inv_freq.device)
        for n in distinct.tolist()  # host lengths: no sync; device ones: one per forward
    ]
    table = torch.stack(rows).float().to(device)  # [n_distinct, h_d/2]
    if index.device.type == "cpu":
        index = host_to_device(index, device)
    return table[index]  # [b, s, h_d/2]
