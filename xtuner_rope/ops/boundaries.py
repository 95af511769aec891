"""Document boundaries over a flattened batch, checked: what every packed-attention backend reads.

``cu_seqlens`` in flash-attn's sense: ``[n_docs + 1]`` offsets into the ``[b * s]`` tokens.
"""

from __future__ import annotations

import torch

from xtuner_rope.ops.inputs import to_int_tensor

__all__ = ["check_flat_boundaries"]


def check_flat_boundaries(cu: object, b: int, s: int, source: str) -> torch.Tensor:
    """Check boundaries over the flattened ``[b * s]`` tokens (flash-attn's ``cu_seqlens``): 1-D
    integer, 0 to ``b * s``, strictly increasing, a boundary at every row end ``r * s``.

    Args:
        cu: ``[n_docs + 1]`` boundaries, e.g. read from XTuner's ``MessageHub``.
        source: where ``cu`` comes from, for the message.

    Returns:
        ``[n_docs + 1]`` int64 boundaries on the CPU.

    Raises:
        TypeError: not integer; ValueError: a rule above is broken.
    """
    fix = (
        "Publish the current batch's boundaries each iteration and reset them to None "
        "afterwards (PackedBatchCheckHook does), built with flat_cumulative."
    )
    cu = to_int_tensor(cu, f"{source}: cumulative_len", fix)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{source}: cumulative_len: expected a 1-D tensor [0, ..., b*s] with "
            f"at least 2 entries, got shape {list(cu.shape)}. {fix}"
        )
    cu = cu.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != b * s:
        raise ValueError(
            f"{source}: cumulative_len {cu.tolist()[:8]}... starting at {int(cu[0])} "
            f"and ending at {int(cu[-1])}, but the attention input has b*s = {b}*{s} "
            f"= {b * s} tokens: expected 0 ... {b * s}. {fix}"
        )
    bad = cu[1:] <= cu[:-1]
    if bool(bad.any()):
        d = int(bad.nonzero()[0])
        raise ValueError(
            f"{source}: cumulative_len: expected strictly increasing boundaries, "
            f"got cumulative_len[{d}:{d + 2}] = {cu[d : d + 2].tolist()} (document "
            f"{d} empty or unordered). {fix}"
        )
    row_ends = torch.arange(1, b) * s
    missing = ~torch.isin(row_ends, cu)
    if bool(missing.any()):
        r = int(missing.nonzero()[0])
        d = int(torch.searchsorted(cu, row_ends[r])) - 1
        raise ValueError(
            f"{source}: cumulative_len: document {d} spans tokens "
            f"[{int(cu[d])}, {int(cu[d + 1])}), across the end of row {r} at "
            f"{int(row_ends[r])} = {r + 1}*s: expected a boundary at every row end "
            f"(rows never share a document). {fix}"
        )
    return cu
