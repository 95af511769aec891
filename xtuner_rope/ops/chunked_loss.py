"""The causal-LM training loss from hidden states, without a ``[tokens, vocab]`` tensor of the row.

A causal LM's own loss (transformers 4.48 ``ForCausalLMLoss``, InternLM2's remote code) projects
every position of ``[b, s]`` onto the vocabulary, upcasts the logits to fp32 and takes the mean
cross-entropy of position ``t`` against label ``t + 1`` over the labels that are not -100. Here
only the hidden states of the supervised positions are gathered (``k`` of the ``b * (s - 1)``),
projected through the model's own head in chunks of ``c`` tokens, and each chunk's fp32
log-softmax, target log-probability and gradient are computed before the next chunk starts: the
largest vocabulary-sized tensor is ``[c, V]``. The gradients (hidden states, head parameters) are
produced in the forward and handed out by the backward, so nothing is recomputed.

Two ways through a chunk:

- ``"linear"``: the head is a plain ``nn.Linear`` (bias or not, weight trained or frozen). The
  softmax gradient is written in place over the chunk's fp32 logits and multiplied into the
  weight's fp32 gradient buffer: one ``[c, V]`` fp32 buffer per chunk.
- ``"module"``: a LoRA-adapted head (peft's ``lora.Linear`` over an ``nn.Linear``): the head
  module itself runs on each chunk and ``torch.autograd.grad`` gives the chunk's gradients of its
  trainable parameters (the adapters: small), so dropout draws its mask once per token.

The loss equals the model's: ``sum(nll) / num_items_in_batch`` when given, else the mean over the
supervised tokens. A micro-batch without one gives 0 and zero gradients (the model's own mean
gives NaN there).
"""

from __future__ import annotations

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
    "head_kind",
    "supervised_positions",
]


def chunk_tokens_for(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within ``chunk_bytes``."""
    return max(MIN_CHUNK_TOKENS, chunk_bytes // (4 * vocab_size))


def head_kind(head: nn.Module) -> tuple[str | None, str]:
    """How the chunked loss runs ``head``: ``("linear" | "module", what)`` or ``(None, why not)``.

    Args:
        head: The causal LM's output head (``lm_head`` / InternLM2's ``output``).
    """
    if type(head) is nn.Linear:
        return "linear", f"nn.Linear({head.in_features}, {head.out_features})"
    base = getattr(head, "base_layer", None)
    if type(base) is nn.Linear and hasattr(head, "lora_A") and hasattr(head, "lora_B"):
        return "module", f"LoRA-adapted nn.Linear({base.in_features}, {base.out_features})"
    return None, f"{type(head).__name__} is not a plain nn.Linear nor a LoRA-adapted one"


def supervised_positions(
    labels: torch.Tensor, shifted: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of the supervised predictions of ``labels`` and their targets.

    Position ``t`` of row ``r`` predicts ``labels[r, t + 1]`` (the model's own shift, over the
    whole row: packed or padded, as the model does), or ``labels[r, t]`` when ``shifted``.

    Args:
        labels: ``[b, s]`` int labels, -100 where not supervised.
        shifted: The labels are already the targets of their positions (sequence parallel's
            shards, shifted over the full row before the split).

    Returns:
        ``(index, targets)``: ``[k]`` flat positions ``r * s + t`` into ``[b * s]`` and their
        ``[k]`` target ids (on the device, reading the count back is one host sync: give
        the host labels where there are).
    """
    b, s = labels.shape
    targets = labels if shifted else labels[:, 1:]  # [b, s or s - 1]: position t's target
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)  # [k], [k]
    return rows * s + cols, targets[rows, cols]


def _check_targets(index, targets, s: int, vocab: int, shift: int) -> None:
    bad = (targets < 0) | (targets >= vocab)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        row, pos = divmod(int(index[first]), s)
        raise ValueError(
            f"chunked_causal_lm_loss: labels[{row}, {pos + shift}] = {int(targets[first])} is "
            f"outside the vocabulary [0, {vocab}) of the model's head (-100 marks an "
            "unsupervised token). Check that the tokenizer matches the model (vocab_size) and "
            "the label masking."
        )


def _check_devices(hidden: torch.Tensor, head: nn.Module) -> None:
    for name, p in head.named_parameters():
        if p.device != hidden.device:
            raise ValueError(
                f"chunked_causal_lm_loss: the head's parameter {name!r} is on {p.device}, the "
                f"hidden states on {hidden.device}: the chunked loss needs them on one device "
                "(a head placed on another device than the last layer is not supported). Set "
                "chunked_loss = False in the config to use the model's own loss."
            )


def _linear_chunk(h, t, head, scale, inv_n, grads, rows):
    """One chunk through an ``nn.Linear`` head; gradients added into ``grads``; summed NLL."""
    x = F.linear(h, head.weight, head.bias).float()  # [c, V] fp32 (a copy unless fp32)
    if scale is not None:
        x = x.mul_(scale)  # Cohere's logit_scale
    # logsumexp in place (torch.logsumexp would hold a second [c, V] buffer)
    top = x.amax(dim=-1, keepdim=True)  # [c, 1]
    picked = x.gather(1, t[:, None])  # [c, 1]
    total = x.sub_(top).exp_().sum(dim=-1, keepdim=True)  # [c, 1]; x = exp(x - top)
    nll = (top + total.log() - picked).sum()
    # d(sum(nll) * inv_n)/dx = (softmax(x) - onehot(t)) * inv_n, written over x.
    x.div_(total).mul_(inv_n)
    x.scatter_add_(1, t[:, None], torch.zeros_like(picked).sub_(inv_n))
    if scale is not None:
        x.mul_(scale)
    g = x.to(head.weight.dtype)  # [c, V], as the model's upcast hands its gradient back
    grads["hidden"][rows] = g @ head.weight  # [c, H]
    if head.weight.requires_grad:
        # fp32 products summed in fp32: a bf16 product per chunk would round once per chunk
        # (measured: 13% further from the fp32 reference than the model's bf16 path).
        grads["weight"].addmm_(x.t(), h.float())
    if head.bias is not None and head.bias.requires_grad:
        grads["bias"].add_(x.sum(0))
    return nll


def _module_chunk(h, t, head, scale, inv_n, params, grads, rows):
    """One chunk through the head module (LoRA); autograd gives the chunk's gradients."""
    with torch.enable_grad():
        h = h.detach().requires_grad_(True)
        x = head(h)
        if scale is not None:
            x = x * scale
        nll = F.cross_entropy(x.float(), t, reduction="sum")
        got = torch.autograd.grad(nll * inv_n, [h, *params])
    grads["hidden"][rows] = got[0]
    for acc, g in zip(grads["params"], got[1:]):
        acc.add_(g)
    return nll.detach()


class _ChunkedNLL(torch.autograd.Function):
    """``sum(nll) * inv_n`` of the selected hidden states; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, targets, inv_n, setup, *params):
        head, kind, scale, chunk = setup
        k = hidden.shape[0]
        grads = {"hidden": torch.zeros_like(hidden)}  # [k, H], filled chunk by chunk
        if kind == "linear":
            w, bias = head.weight, head.bias
            grads["weight"] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            if bias is not None:
                grads["bias"] = torch.zeros(bias.shape, dtype=torch.float32, device=w.device)
        else:
            grads["params"] = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for a in range(0, k, chunk):
            rows = slice(a, a + chunk)
            h, t = hidden[rows], targets[rows]
            if kind == "linear":
                total += _linear_chunk(h, t, head, scale, inv_n, grads, rows)
            else:
                total += _module_chunk(h, t, head, scale, inv_n, params, grads, rows)
        hidden_grad = grads["hidden"]
        if kind == "linear":
            named = {"weight": grads["weight"], "bias": grads.get("bias")}
            param_grads = [named["weight" if p is head.weight else "bias"] for p in params]
        else:
            param_grads = grads["params"]
        ctx.grads = (hidden_grad, param_grads)
        ctx.dtypes = [p.dtype for p in params]
        return total * inv_n

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
    (transformers 4.48; InternLM2's remote-code mean is the same without ``num_items_in_batch``)
    in value and gradients, without a ``[b * s, V]`` tensor.

    Args:
        hidden: ``[b, s, H]`` the decoder's last hidden states (after the final norm).
        labels: ``[b, s]`` int labels aligned with the inputs (-100: not supervised); position
            ``t`` predicts ``labels[:, t + 1]``.
        head: The output head (``head_kind`` must accept it): ``[H] -> [V]``.
        logit_scale: Multiplies the logits before the softmax (Cohere), or None.
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
    kind, what = head_kind(head)
    if kind is None:
        raise ValueError(f"chunked_causal_lm_loss: unsupported head: {what}.")
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"chunked_causal_lm_loss: expected hidden [b, s, H] and labels [b, s], got "
            f"{tuple(hidden.shape)} and {tuple(labels.shape)}."
        )
    _check_devices(hidden, head)
    b, s, width = hidden.shape
    vocab = head.out_features
    # The positions from the labels' host copy (the collated batch, ``ops.host_copies``) where
    # there is one: no read of the device's labels, and the count is known on the host.
    host = host_copy(labels)
    index, targets = supervised_positions(
        host if host is not None else labels.to(hidden.device), shifted
    )
    _check_targets(index, targets, s, vocab, 0 if shifted else 1)
    if index.device != hidden.device:
        index = index.to(hidden.device, non_blocking=True)
        targets = targets.to(hidden.device, non_blocking=True)
    if num_items_in_batch is None:
        inv_n = 1.0 / max(int(index.numel()), 1)
    elif isinstance(num_items_in_batch, torch.Tensor):
        inv_n = 1.0 / num_items_in_batch.to(hidden.device, torch.float32)
    else:
        inv_n = 1.0 / num_items_in_batch
    selected = hidden.reshape(b * s, width).index_select(0, index)  # [k, H]
    params = [p for p in head.parameters() if p.requires_grad]
    chunk = chunk_tokens or chunk_tokens_for(vocab)
    setup = (head, kind, logit_scale, chunk)
    return _ChunkedNLL.apply(selected, targets, inv_n, setup, *params)
