"""Sequence parallel (XTuner's Ulysses all-to-all over heads) for packed rows.

Each rank holds ``S / sp`` tokens of every ``[b, S]`` row; an all-to-all around attention
trades the sequence split for a head split. Positions are the full row's; the attention reads
the **full row's** boundaries (:func:`shard_rows` publishes them, a row not a multiple of ``sp``
padded by a segment of its own); labels are shifted over the full row before the split (XTuner
0.2.0 drops each later shard's first label); the loss is the one-rank token mean (XTuner
back-propagates each rank's unweighted mean). GQA: kv heads unrepeated when ``sp`` divides them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from xtuner_rope.batch.items import IGNORE_INDEX
from xtuner_rope.ops.attention import document_plan, packed_attention
from xtuner_rope.ops.host_copies import host_copy, remember_host_copy
from xtuner_rope.ops.packing import cumulative_from_position_ids, flat_cumulative
from xtuner_rope.ops.rope_documents import document_lengths

from . import channel
from .channel import VARLEN_HUB
from .chunked_loss import causal_lm, chunked_now, hidden_loss
from .runtime import choose_backend, hub_cumulative_len

__all__ = [
    "full_row_plan",
    "sequence_parallel_active",
    "sequence_parallel_attention",
    "sequence_parallel_loss",
    "sequence_parallel_size",
    "shard_rows",
]


def sequence_parallel_size() -> int:
    """XTuner's sequence-parallel world size (1 when no group was initialised)."""
    from xtuner.parallel.sequence import get_sequence_parallel_world_size

    return get_sequence_parallel_world_size() if dist.is_initialized() else 1


def sequence_parallel_active(layer: nn.Module) -> bool:
    """True where ``layer`` sees a shard of the row: training with ``sp > 1`` (as XTuner decides)."""
    return layer.training and sequence_parallel_size() > 1


def full_row_plan(b: int, s_full: int, device: torch.device):
    """The documents of the full ``[b, S]`` rows, from the boundaries ``shard_rows`` published.

    Raises:
        RuntimeError: nothing published (the batch did not go through ``shard_rows``).
    """
    published = hub_cumulative_len()
    if published is None:
        raise RuntimeError(
            "xtuner-rope sequence parallel: no full-row boundaries published for this batch "
            f"(MessageHub '{VARLEN_HUB}'). Shards alone cannot tell where documents are; train "
            "through SupervisedFinetune (xtuner_rope.compat patches its sequence-parallel loss) "
            "or call models.sequence_parallel.sequence_parallel_loss."
        )
    return document_plan(
        None,
        b,
        s_full,
        device,
        published=published,
        source=f"MessageHub '{VARLEN_HUB}' (full row, sequence parallel)",
    )


def sequence_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eager: bool
) -> torch.Tensor:
    """Packed attention of one shard's heads over the full row, through XTuner's all-to-all.

    Args:
        q: ``[b, S/sp, n_h, h_d]`` this rank's shard of queries (RoPE applied).
        k, v: ``[b, S/sp, n_kv, h_d]`` keys (RoPE applied) and values of the shard.
        eager: Whether the layer's dense kernel is eager softmax (else SDPA), for the backend.

    Returns:
        ``[b, S/sp, n_h, h_d]`` attention output of this rank's shard, every token attending
        only within its document of the full row.
    """
    from xtuner.parallel.sequence import (
        post_process_for_sequence_parallel_attn,
        pre_process_for_sequence_parallel_attn,
    )

    sp = sequence_parallel_size()
    n_h, n_kv = q.shape[2], k.shape[2]
    if n_h % sp and q.device.type == "cpu":
        raise ValueError(
            f"sequence_parallel_size = {sp} does not divide the {n_h} attention heads: XTuner's "
            "inner sequence parallel (its fallback for that) gathers through "
            "gather_for_sequence_parallel, which refuses CPU tensors (xtuner 0.2.0). Set "
            f"sequence_parallel_size to a divisor of {n_h}, or train on GPUs."
        )
    if n_kv % sp or n_h % sp:  # XTuner's own GQA route: repeat kv to n_h heads
        k, v = (x.repeat_interleave(n_h // n_kv, dim=2) for x in (k, v))  # [b, S/sp, n_h, h_d]
    # [b, S/sp, heads, h_d] -> [b, S, heads/sp, h_d] (head-dim split too under inner SP)
    q, k, v = pre_process_for_sequence_parallel_attn(q, k, v)
    b, s_full = q.shape[:2]
    plan = full_row_plan(b, s_full, q.device)
    out = packed_attention(q, k, v, plan, choose_backend(q, eager))  # [b, S, n_h/sp, h_d]
    return post_process_for_sequence_parallel_attn(out).contiguous()  # [b, S/sp, n_h, h_d]


def _host_values(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host: its remembered host copy (the collated batch), else read back."""
    host = host_copy(x)
    return x.detach().cpu() if host is None else host


def _row_boundaries(data: dict, b: int, s: int) -> list[torch.Tensor]:
    """Per-row ``[0, ..., s]`` boundaries, on the host: the published flat ones, else the
    positions' resets."""
    flat = hub_cumulative_len()
    if flat is not None:
        flat = _host_values(torch.as_tensor(flat)).to(torch.int64).reshape(-1)
    if flat is not None and int(flat[-1]) == b * s:  # else stale: read the positions
        rows = []
        for r in range(b):
            inside = flat[(flat >= r * s) & (flat <= (r + 1) * s)]
            rows.append((inside - r * s).to(torch.int32))
        return rows
    positions = data.get("position_ids")
    if positions is None:
        return [torch.tensor([0, s], dtype=torch.int32)] * b
    return [cumulative_from_position_ids(row) for row in _host_values(positions).expand(b, s)]


def _pad_row_tail(data: dict, rows: list[torch.Tensor], s: int, pad: int, pad_index: int):
    """Append ``pad`` tokens to every row as a segment of their own (positions ``0..pad-1``,
    labels ignored), on the batch's device."""
    b = data["input_ids"].shape[0]
    device = data["input_ids"].device

    def tail(x: torch.Tensor, fill) -> torch.Tensor:
        if not torch.is_tensor(fill):
            fill = torch.full((b, pad), fill, dtype=x.dtype, device=x.device)
        return torch.cat([x, fill.to(x.device, x.dtype)], dim=1)  # [b, s + pad]

    data["input_ids"] = tail(data["input_ids"], pad_index)
    data["labels"] = tail(data["labels"], IGNORE_INDEX)
    positions = data.get("position_ids")
    if positions is None:
        positions = torch.arange(s, device=device).expand(b, s)
    tail_positions = torch.arange(pad, device=positions.device).expand(b, pad)
    data["position_ids"] = tail(positions.expand(b, s), tail_positions)
    return [torch.cat([cu, torch.tensor([s + pad], dtype=cu.dtype)]) for cu in rows]


def _host_positions(positions: torch.Tensor | None, b: int, s: int, pad: int):
    """The full rows' ``[b, s + pad]`` positions on the host, as ``_pad_row_tail`` pads them, or
    None when only the device holds them."""
    host = torch.arange(s).expand(b, s) if positions is None else host_copy(positions)
    if host is None:
        return None
    host = host.expand(b, s)
    return torch.cat([host, torch.arange(pad).expand(b, pad)], dim=1) if pad else host


def shard_rows(data: dict, sp: int, rank: int, pad_index: int = 0) -> tuple[dict, int]:
    """This rank's shard of a full ``[b, S]`` batch: rows padded to a multiple of ``sp`` (a
    segment of their own), the full row's boundaries published for the attention after the
    all-to-all, labels shifted over the full row, then everything split along the sequence.

    Args:
        data: ``input_ids``, ``labels`` ``[b, S]``, optional ``position_ids`` ``[b, S]``
            (per-document positions); not modified.
        sp: Sequence-parallel world size; rank: this rank in the group.

    Returns:
        The shard's ``input_ids``, ``position_ids`` and ``shifted_labels`` (``[b, S'/sp]``,
        ``S'`` the padded length: the label each token predicts), and the number of supervised
        tokens of the full batch.
    """
    data = dict(data)
    b, s = data["input_ids"].shape
    rows = _row_boundaries(data, b, s)
    pad = (-s) % sp
    host_labels = host_copy(data["labels"])  # the chunked loss reads the shard's on the host
    counted = data["labels"] if host_labels is None else host_labels  # no device read if known
    n_supervised = int((counted[:, 1:] != IGNORE_INDEX).sum())  # of the full rows, after the shift
    host_positions = _host_positions(data.get("position_ids"), b, s, pad)
    if pad:
        rows = _pad_row_tail(data, rows, s, pad, pad_index)
    s_full = s + pad
    flat = flat_cumulative(rows, s_full)
    # On the host: the plan after the all-to-all reads them without a device sync.
    channel.publish(flat, int((flat[1:] - flat[:-1]).max()))
    labels = data["labels"]
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    positions = data.get("position_ids")
    if positions is None:
        positions = torch.arange(s_full, device=labels.device)
    positions = positions.expand(b, s_full)
    width = s_full // sp
    cut = slice(rank * width, (rank + 1) * width)
    # Length-dependent RoPE of the shard needs each token's document length in the full row.
    if host_positions is not None:  # on the host, like the rotary's range check of the shard
        lengths = document_lengths(host_positions, flat, b, s_full)  # [b, S']
    else:
        lengths = document_lengths(positions, flat.to(positions.device), b, s_full)
    channel.publish_lengths(lengths[:, cut])
    shard = {
        "input_ids": data["input_ids"][:, cut],
        "position_ids": positions[:, cut],
        "shifted_labels": shifted[:, cut],
    }
    if host_positions is not None:
        remember_host_copy(shard["position_ids"], host_positions[:, cut])
    if host_labels is not None:
        host_labels = F.pad(host_labels, (0, pad + 1), value=IGNORE_INDEX)[:, 1:]  # [b, S']
        remember_host_copy(shard["shifted_labels"], host_labels[:, cut])
    return shard, n_supervised


class _GroupSum(torch.autograd.Function):
    """Forward: the sum over the group; backward: ``scale`` (``sp``) times the gradient, so the
    data-parallel average over every rank is the gradient of the group's sum (the one-rank one)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group, scale: float) -> torch.Tensor:
        ctx.scale = scale
        total = value.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None, None


def sequence_parallel_loss(llm: nn.Module, data: dict, pad_index: int = 0) -> dict:
    """The token-weighted SFT loss of a full batch under sequence parallel (every label once).

    Args:
        data: The full batch as collated: ``input_ids``, ``labels`` ``[b, S]``, optional
            ``position_ids``; ``attention_mask`` is not used (boundaries are).
        pad_index: Token id of the padding segment added when ``S % sp != 0``.

    Returns:
        ``{'loss': scalar}``: the mean cross-entropy over the batch's supervised tokens, equal
        on every rank of the group; back-propagating it gives every rank its share of the
        one-rank gradient (see ``_GroupSum``).
    """
    from xtuner.parallel.sequence import get_sequence_parallel_group, get_sequence_parallel_rank

    sp = sequence_parallel_size()
    if not llm.training:  # the attention runs whole rows outside training (as XTuner decides)
        sp = 1
    shard, n_supervised = shard_rows(
        data, sp, get_sequence_parallel_rank() if sp > 1 else 0, pad_index
    )
    inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
    if chunked_now(llm):  # the chunked loss of the shard's hidden states, same reduction
        hidden = causal_lm(llm).get_decoder()(**inputs, use_cache=False, return_dict=True)
        local = hidden_loss(
            llm,
            hidden.last_hidden_state,  # [b, S/sp, H]
            shard["shifted_labels"],
            num_items_in_batch=max(n_supervised, 1),
            shifted=True,
        )
    else:
        logits = llm(**inputs, use_cache=False).logits  # [b, S/sp, vocab]
        token_sum = F.cross_entropy(
            logits.float().flatten(0, 1),
            shard["shifted_labels"].flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        local = token_sum / max(n_supervised, 1)
    if sp == 1:
        return {"loss": local}
    return {"loss": _GroupSum.apply(local, get_sequence_parallel_group(), float(sp))}
