"""The causal-LM training loss from hidden states, without a ``[tokens, vocab]`` tensor of the row.

Only the hidden states of the supervised positions are gathered (``k`` of ``b * (s - 1)``) and
projected through the model's own head in chunks of ``c`` tokens; each chunk's fp32
log-softmax, target log-prob and gradient are done before the next starts (largest tensor
``[c, V]``). The gradients are computed in the forward (the softmax gradient written in place
over the chunk's logits; the head's in fp32) and handed out by the backward. A head is a plain
``nn.Linear`` or peft's vanilla LoRA ``lora.Linear``, run from its parameters (no module call:
DeepSpeed ZeRO-3, ``models.chunked_loss``). The loss equals the model's
(``sum(nll) / num_items_in_batch``, else the mean); nothing
supervised gives 0 and zero gradients. ``chunked_target_logprobs`` gives the ``[b, s]`` target
log-probs instead (DPO, ORPO, held-out): its backward runs each chunk again. A LoRA head's
dropout masks are the rows of the one draw peft makes over the whole ``[b, s, H]`` input.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from xtuner_rope.ops.host_copies import host_copy

IGNORE_INDEX = -100  # XTuner's and transformers' label of an unsupervised token
# The fp32 logits of one chunk: [c, V] * 4 bytes at most (tools/bench/loss.py, docs/packing.md).
CHUNK_BYTES = 128 * 2**20
MIN_CHUNK_TOKENS = 64

__all__ = [
    "CHUNK_BYTES",
    "IGNORE_INDEX",
    "chunk_tokens_for",
    "chunked_causal_lm_loss",
    "chunked_target_logprobs",
    "head_kind",
    "head_modules",
    "supervised_positions",
]


def chunk_tokens_for(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within ``chunk_bytes``."""
    return max(MIN_CHUNK_TOKENS, chunk_bytes // (4 * vocab_size))


def head_kind(head: nn.Module) -> tuple[str | None, str]:
    """How the chunked loss runs the output ``head``: ``("linear" | "lora", what)`` or
    ``(None, why not)``."""
    if type(head) is nn.Linear:
        return "linear", f"nn.Linear({head.in_features}, {head.out_features})"
    base = getattr(head, "base_layer", None)
    if type(base) is not nn.Linear or not hasattr(head, "lora_A") or not hasattr(head, "lora_B"):
        return None, f"{type(head).__name__} is not a plain nn.Linear nor a LoRA-adapted one"
    what = f"LoRA-adapted nn.Linear({base.in_features}, {base.out_features})"
    if getattr(head, "lora_variant", None) or any(getattr(head, "use_dora", {}).values()):
        return None, f"{what} with DoRA or another LoRA variant (not supported yet)"
    kinds = {type(m) for d in (head.lora_A, head.lora_B, head.lora_dropout) for m in d.values()}
    if not kinds <= {nn.Linear, nn.Dropout, nn.Identity}:
        return None, f"{what} whose adapters are not nn.Linear (dropout: nn.Dropout) layers"
    return "lora", what


def _adapters(head: nn.Module) -> list[str]:
    """The adapters a LoRA head's forward runs: its active ones, none while disabled."""
    return [] if head.disable_adapters else [a for a in head.active_adapters if a in head.lora_A]


def head_modules(head: nn.Module) -> list[nn.Module]:
    """The modules whose own parameters the chunked loss reads from ``head`` (one ``head_kind``
    accepts): the head, or a LoRA head's base_layer and its running adapters' lora_A, lora_B."""
    if head_kind(head)[0] != "lora":
        return [head]
    pairs = [(head.lora_A[a], head.lora_B[a]) for a in _adapters(head)]
    return [head.base_layer, *(m for pair in pairs for m in pair)]


def _dropout_masks(head: nn.Module, hidden: torch.Tensor, index: torch.Tensor) -> list:
    """Per adapter ``_lora_forward`` runs, rows ``index`` ``[k, H]`` of the dropout mask (scaled
    by ``1 / (1 - p)``) that peft 0.21's forward draws over the head's whole input ``hidden``
    ``[b, s, H]``: the same RNG call on the same shape and dtype, so the same numbers as the
    model's own loss. None where the adapter drops nothing (no dropout, or eval mode)."""
    masks, dtype = [], hidden.dtype
    for name in _adapters(head):
        a, drop = head.lora_A[name], head.lora_dropout[name]
        if getattr(head, "cast_input_dtype_enabled", True):
            dtype = a.weight.dtype  # peft casts the input to lora_A's dtype, then drops
        if type(drop) is not nn.Dropout or not drop.training:
            masks.append(None)
            continue
        full = F.dropout(hidden.new_ones(hidden.shape, dtype=dtype), drop.p)  # [b, s, H]
        masks.append(full.view(-1, hidden.shape[-1]).index_select(0, index))  # [k, H]
    return masks


def _lora_forward(head: nn.Module, h: torch.Tensor, masks: list) -> tuple[torch.Tensor, list]:
    """peft 0.21's vanilla ``lora.Linear.forward`` from the head's parameters, no module called,
    with the rows' dropout ``masks`` of :func:`_dropout_masks`: the ``[c, V]`` output and per
    adapter ``(lora_A, lora_B, scaling, its input [c, H], lora_A's output [c, r], mask)``.

    Raises:
        ValueError: a merged head (its adapters are already in the base weight)."""
    if head.merged:
        raise ValueError(
            "chunked loss: the LoRA head's adapters are merged into its weight; unmerge them "
            "(peft: unmerge_adapter()) or set chunked_loss = False."
        )
    base = head.base_layer
    out = F.linear(h, base.weight, base.bias)
    x, dtype, parts = h, out.dtype, []
    for name, mask in zip(_adapters(head), masks):  # none under disable_adapter() (DPO's ref)
        a, b = head.lora_A[name], head.lora_B[name]
        if getattr(head, "cast_input_dtype_enabled", True):
            x = x.to(a.weight.dtype)
        dropped = x if mask is None else x * mask
        u = F.linear(dropped, a.weight, a.bias)  # [c, r]
        lora = F.linear(u, b.weight, b.bias).mul_(head.scaling[name])  # [c, V]
        out = out.add_(lora) if lora.dtype == out.dtype else out + lora  # no third [c, V]
        parts.append((a, b, head.scaling[name], dropped, u, mask))
    return out.to(dtype), parts


def supervised_positions(
    labels: torch.Tensor, shift: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of the supervised predictions of ``labels`` and their targets.

    Args:
        labels: ``[b, s]`` int labels, -100 where not supervised.
        shift: Whether position ``t``'s target is ``labels[:, t + 1]`` (else ``labels[:, t]``).

    Returns:
        ``(index, targets)``: ``[k]`` flat positions ``r * s + t`` into ``[b * s]`` and their
        ``[k]`` target ids (on ``labels``' device: give the host labels where there are).
    """
    b, s = labels.shape
    shifted = labels[:, 1:] if shift else labels  # [b, s - shift]: position t's target
    rows, cols = (shifted != IGNORE_INDEX).nonzero(as_tuple=True)  # [k], [k]
    return rows * s + cols, shifted[rows, cols]


def _check_targets(who, index, targets, s, vocab, shift) -> None:
    bad = (targets < 0) | (targets >= vocab)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        row, pos = divmod(int(index[first]), s)
        raise ValueError(
            f"{who}: labels[{row}, {pos + shift}] = {int(targets[first])} is "
            f"outside the vocabulary [0, {vocab}) of the model's head (-100 marks an "
            "unsupervised token). Check that the tokenizer matches the model (vocab_size) and "
            "the label masking."
        )


def _check_devices(who, hidden: torch.Tensor, head: nn.Module) -> None:
    for name, p in head.named_parameters():
        if p.device != hidden.device:
            raise ValueError(
                f"{who}: the head's parameter {name!r} is on {p.device}, the "
                f"hidden states on {hidden.device}: the chunked loss needs them on one device "
                "(a head placed on another device than the last layer is not supported). Set "
                "chunked_loss = False in the config to use the model's own loss."
            )


def _nll_in_place(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[c]`` NLL of targets ``t`` under fp32 logits ``x`` ``[c, V]`` (overwritten with
    ``exp(x - max)``: no second ``[c, V]`` buffer), and their ``[c, 1]`` sums."""
    top = x.amax(dim=-1, keepdim=True)  # [c, 1]
    picked = x.gather(1, t[:, None])  # [c, 1]
    total = x.sub_(top).exp_().sum(dim=-1, keepdim=True)  # [c, 1]
    # In log_softmax's order, (x_t - max) - log(sum): the per-token values match it closest.
    return (total.log() - (picked - top))[:, 0], total


def _logit_grad(x, t, scale, coef) -> tuple[torch.Tensor, torch.Tensor]:
    """``[c]`` NLL of the fp32 logits ``x`` ``[c, V]`` (times ``scale``), and ``x`` overwritten
    with ``d(coef * nll) / dx`` (``coef``: a number, or ``[c]`` per token)."""
    if scale is not None:
        x.mul_(scale)  # Cohere's logit_scale
    nll, total = _nll_in_place(x, t)
    if isinstance(coef, torch.Tensor) and coef.dim():
        coef = coef[:, None]  # [c, 1]
    # d(coef * nll)/dx = (softmax(x) - onehot(t)) * coef, written over x.
    x.div_(total).mul_(coef)
    x.scatter_add_(1, t[:, None], torch.zeros_like(total).sub_(coef))
    return nll, (x.mul_(scale) if scale is not None else x)


def _linear_grads(layer, g, x, grads, alpha=1.0) -> None:
    """Add ``alpha`` times ``layer``'s weight and bias gradients for output gradient ``g`` ``[c,
    out]`` (fp32), input ``x`` ``[c, in]`` to ``grads`` (by parameter id; absent: frozen). fp32
    products summed in fp32: a bf16 product per chunk would round once per chunk (measured: 13%
    further from the fp32 reference than the model's bf16 path)."""
    if id(layer.weight) in grads:
        grads[id(layer.weight)].addmm_(g.t(), x.float(), alpha=alpha)
    if layer.bias is not None and id(layer.bias) in grads:
        grads[id(layer.bias)].add_(g.sum(0), alpha=alpha)


class _Setup(NamedTuple):
    """What every chunk of one call runs with: the head, ``head_kind``'s kind, the logit scale
    (or None), tokens per chunk, and the LoRA adapters' ``[k, H]`` dropout masks (``_dropout_masks``)."""

    head: nn.Module
    kind: str
    scale: float | None
    chunk: int
    masks: list


def _head_out(setup: _Setup, h: torch.Tensor, rows: slice) -> tuple[nn.Module, torch.Tensor, list]:
    """The selected rows ``rows`` (``h`` ``[c, H]``) through the head from its parameters: ``(the
    linear layer holding the vocabulary weight, the [c, V] output, the LoRA parts of
    _lora_forward)``."""
    head = setup.head
    if setup.kind == "linear":
        return head, F.linear(h, head.weight, head.bias), []
    masks = [m if m is None else m[rows] for m in setup.masks]
    return head.base_layer, *_lora_forward(head, h, masks)


def _head_chunk(h, t, setup, coef, grads, rows) -> torch.Tensor:
    """One chunk through the head: its ``[c]`` NLL; ``coef * d(nll)`` added into ``grads``
    (``"hidden"``: the rows' hidden-state gradient; by parameter id: the head's, fp32)."""
    base, out, parts = _head_out(setup, h, rows)
    nll, x = _logit_grad(out.float(), t, setup.scale, coef)  # x: [c, V] fp32 (a copy unless fp32)
    hidden_grad = x.to(out.dtype) @ base.weight  # [c, H]: as the model's upcast hands it back
    _linear_grads(base, x, h, grads)
    for a, b, scaling, dropped, u, mask in parts:  # out += lora_B(lora_A(dropped)) * scaling
        _linear_grads(b, x, u, grads, alpha=scaling)
        du = (x @ b.weight.float()).mul_(scaling)  # [c, r] fp32
        _linear_grads(a, du, dropped, grads)
        dx = du.to(a.weight.dtype) @ a.weight  # [c, H]
        hidden_grad += (dx if mask is None else dx * mask).to(hidden_grad.dtype)
    grads["hidden"][rows] = hidden_grad
    return nll


def _run_chunks(hidden, targets, setup, params, coef):
    """Every chunk through the head: the ``[k]`` NLL and ``coef``-weighted gradients of
    ``hidden`` and ``params`` (fp32 for the head's), as ``(nll, hidden_grad, param_grads)``."""
    chunk = setup.chunk
    grads = {id(p): torch.zeros_like(p, dtype=torch.float32) for p in params}
    grads["hidden"] = torch.zeros_like(hidden)  # [k, H], filled chunk by chunk
    nll = [hidden.new_zeros(0, dtype=torch.float32)]
    for a in range(0, hidden.shape[0], chunk):
        rows = slice(a, a + chunk)
        c = coef[rows] if isinstance(coef, torch.Tensor) and coef.dim() else coef
        nll.append(_head_chunk(hidden[rows], targets[rows], setup, c, grads, rows))
    return torch.cat(nll), grads["hidden"], [grads[id(p)] for p in params]


class _ChunkedNLL(torch.autograd.Function):
    """``sum(nll) * inv_n`` of the selected hidden states; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, targets, inv_n, setup, *params):
        nll, hidden_grad, param_grads = _run_chunks(hidden, targets, setup, params, inv_n)
        ctx.grads = (hidden_grad, param_grads)
        ctx.dtypes = [p.dtype for p in params]
        return nll.sum() * inv_n

    @staticmethod
    def backward(ctx, grad):
        if ctx.grads is None:
            raise RuntimeError(
                "chunked_causal_lm_loss: backward ran twice through the same loss (its "
                "gradients are computed once, in the forward); run the forward again."
            )
        hidden_grad, param_grads = ctx.grads
        ctx.grads = None
        out = [g.mul_(grad).to(dtype) for g, dtype in zip(param_grads, ctx.dtypes)]
        return (hidden_grad.mul_(grad.to(hidden_grad.dtype)), None, None, None, *out)


class _ChunkedTargetLogProbs(torch.autograd.Function):
    """``[k]`` log-probs of the targets; the backward runs each chunk again (no logits kept)."""

    @staticmethod
    def forward(ctx, hidden, targets, setup, *params):
        scale, chunk = setup.scale, setup.chunk
        nll = [hidden.new_zeros(0, dtype=torch.float32)]
        for a in range(0, hidden.shape[0], chunk):  # no gradients here: NLL only
            x = _head_out(setup, hidden[a : a + chunk], slice(a, a + chunk))[1].float()  # [c, V]
            if scale is not None:
                x.mul_(scale)  # Cohere's logit_scale
            nll.append(_nll_in_place(x, targets[a : a + chunk])[0])
        ctx.save_for_backward(hidden, targets)
        ctx.setup, ctx.params = setup, params
        return torch.cat(nll).neg_()

    @staticmethod
    def backward(ctx, grad):
        hidden, targets = ctx.saved_tensors
        # d(sum g * logp) = d(sum (-g) * nll): the upstream gradient weighs each token's NLL.
        _, hidden_grad, param_grads = _run_chunks(
            hidden, targets, ctx.setup, ctx.params, grad.float().neg()
        )
        out = [g.to(p.dtype) for g, p in zip(param_grads, ctx.params)]
        return (hidden_grad, None, None, *out)


def _select(who, hidden, labels, head, shift, logit_scale, chunk_tokens):
    """The checks, then ``(index, targets, selected [k, H], params, setup)``."""
    kind, what = head_kind(head)
    if kind is None:
        raise ValueError(f"{who}: unsupported head: {what}.")
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"{who}: expected hidden [b, s, H] and labels [b, s], got "
            f"{tuple(hidden.shape)} and {tuple(labels.shape)}."
        )
    _check_devices(who, hidden, head)
    b, s, width = hidden.shape
    # The positions from the labels' host copy (the collated batch, ``ops.host_copies``) where
    # there is one: no read of the device's labels, and the count is known on the host.
    host = host_copy(labels)
    index, targets = supervised_positions(
        host if host is not None else labels.to(hidden.device), shift
    )
    _check_targets(who, index, targets, s, head.out_features, shift)
    if index.device != hidden.device:
        index = index.to(hidden.device, non_blocking=True)
        targets = targets.to(hidden.device, non_blocking=True)
    selected = hidden.reshape(b * s, width).index_select(0, index)  # [k, H]
    params = [p for p in head.parameters() if p.requires_grad]
    chunk = chunk_tokens or chunk_tokens_for(head.out_features)
    masks = _dropout_masks(head, hidden, index) if kind == "lora" else []
    return index, targets, selected, params, _Setup(head, kind, logit_scale, chunk, masks)


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module,
    *,
    logit_scale: float | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    shifted: bool = False,
) -> torch.Tensor:
    """The model's causal-LM loss from its last hidden states, chunk by chunk.

    Equals ``ForCausalLMLoss(head(hidden) * logit_scale, labels, V, num_items_in_batch)``
    (transformers 4.48) in value and gradients, without a ``[b * s, V]`` tensor.

    Args:
        hidden: ``[b, s, H]`` the decoder's last hidden states (after the final norm).
        labels: ``[b, s]`` int labels aligned with the inputs (-100: not supervised); position
            ``t`` predicts ``labels[:, t + 1]``.
        head: The output head (``head_kind`` must accept it): ``[H] -> [V]``.
        logit_scale: Multiplies the logits (Cohere), or None.
        num_items_in_batch: The denominator of the summed NLL (transformers' gradient
            accumulation), or None for the mean over this batch's supervised tokens.
        chunk_tokens: Tokens per chunk; default ``chunk_tokens_for(V)``.
        shifted: ``labels[:, t]`` is already position ``t``'s target (no shift here).

    Returns:
        The fp32 scalar loss; 0 (zero gradients, graph kept) when nothing is supervised.

    Raises:
        ValueError: a head ``head_kind`` refuses, a head on another device than ``hidden``,
            shapes that disagree, or a supervised label outside ``[0, V)`` (named by row and
            position).
    """
    who = "chunked_causal_lm_loss"
    index, targets, selected, params, setup = _select(
        who, hidden, labels, head, not shifted, logit_scale, chunk_tokens
    )
    if num_items_in_batch is None:
        inv_n = 1.0 / max(int(index.numel()), 1)
    elif isinstance(num_items_in_batch, torch.Tensor):
        inv_n = 1.0 / num_items_in_batch.to(hidden.device, torch.float32)
    else:
        inv_n = 1.0 / num_items_in_batch
    return _ChunkedNLL.apply(selected, targets, inv_n, setup, *params)


def chunked_target_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: nn.Module,
    *,
    logit_scale: float | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token fp32 ``log_softmax(head(hidden) * logit_scale)`` at the targets, chunk by chunk.

    Equals ``log_softmax(logits.float(), -1).gather(-1, targets)`` where ``targets`` is not
    -100 (0 elsewhere), in value and gradients, without a ``[b * s, V]`` tensor in the forward
    or the backward.

    Args: as :func:`chunked_causal_lm_loss`, with ``targets`` ``[b, s]`` the id position ``t``
        predicts (already shifted), -100 where no log-prob is wanted.

    Returns:
        ``[b, s]`` fp32 target log-probs, 0 where ``targets`` is -100.

    Raises:
        ValueError: as :func:`chunked_causal_lm_loss`.
    """
    index, ids, selected, params, setup = _select(
        "chunked_target_logprobs", hidden, targets, head, False, logit_scale, chunk_tokens
    )
    logp = _ChunkedTargetLogProbs.apply(selected, ids, setup, *params)  # [k]
    b, s = targets.shape
    return logp.new_zeros(b * s).index_copy(0, index, logp).view(b, s)
