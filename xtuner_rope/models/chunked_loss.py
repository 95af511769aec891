"""The causal LM's training loss through ``ops.chunked_loss``: the instance ``forward`` patch.

``patch_chunked_loss`` replaces the causal LM instance's ``forward`` (so peft's ``LoraModel``
reaches it). A call with ``labels`` inside :func:`loss_only` runs the decoder, then
``chunked_causal_lm_loss``, and returns ``loss`` with ``logits=None``; inside
:func:`target_logprobs_only` (DPO/ORPO: labels already shifted) it returns the ``[b, s, 1]``
target log-probs as ``logits`` (:func:`is_target_logprobs`); every other call is the model's
own ``forward``. :func:`pause_chunked_loss` gives back the model's own loss and logits. Under
ZeRO-3 the whole loss runs inside one call of each head module owning parameters
(:func:`head_call`), so DeepSpeed gathers each once per forward and backward and reduces its
gradient into the partition.
"""

from __future__ import annotations

import contextvars
import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from xtuner_rope.ops.chunked_loss import (
    IGNORE_INDEX,
    chunk_tokens_for,
    chunked_causal_lm_loss,
    chunked_target_logprobs,
    head_kind,
    head_modules,
)
from xtuner_rope.ops.host_copies import host_copy, remember_host_copy

# What a call with labels returns inside a block: "loss" (loss_only) or "logprobs".
_MODE = contextvars.ContextVar("xtuner_rope_chunked_mode", default=None)
_ORIGINAL = "_xtuner_rope_own_forward"  # the instance attribute holding the model's forward

__all__ = [
    "UnsupportedHead",
    "causal_lm",
    "chunked_loss_head",
    "chunked_now",
    "head_call",
    "hidden_loss",
    "is_chunked",
    "is_target_logprobs",
    "loss_only",
    "partitioned",
    "patch_chunked_loss",
    "pause_chunked_loss",
    "shifted_targets",
    "target_logprobs_only",
]


class UnsupportedHead(ValueError):
    """The model's loss cannot go through the chunked loss; the message says why."""


@contextmanager
def _mode(mode: str) -> Iterator[None]:
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def loss_only():
    """Calls with ``labels`` inside this block return the chunked loss and no logits."""
    return _mode("loss")


def target_logprobs_only():
    """Calls with ``labels`` (already shifted; -100: none) inside this block return as ``logits``
    the ``[b, s, 1]`` fp32 target log-probs (0 where -100), and no loss."""
    return _mode("logprobs")


def is_target_logprobs(logits: torch.Tensor) -> bool:
    """Whether ``logits`` (or ORPO's slice of them) are :func:`target_logprobs_only`'s log-probs."""
    return _MODE.get() == "logprobs" and logits.shape[-1] == 1


def causal_lm(llm: nn.Module) -> nn.Module:
    """The causal LM itself: ``llm``, or the model inside peft's ``PeftModel``."""
    get_base = getattr(llm, "get_base_model", None)
    return get_base() if callable(get_base) else llm


def chunked_loss_head(model: nn.Module) -> tuple[nn.Module, float | None, str]:
    """The head, logit scale and a description of how ``model``'s loss would be chunked.

    Raises:
        UnsupportedHead: the model's loss is more than its head's cross-entropy, or its head is
            not one ``ops.chunked_loss.head_kind`` runs.
    """
    config = getattr(model, "config", None)
    name = type(model).__name__
    get_head, get_decoder = (
        getattr(model, n, None) for n in ("get_output_embeddings", "get_decoder")
    )
    if not callable(get_head) or not callable(get_decoder):
        raise UnsupportedHead(f"{name} has no get_output_embeddings / get_decoder")
    if getattr(config, "pretraining_tp", 1) > 1 and name == "InternLM2ForCausalLM":
        raise UnsupportedHead(f"{name} splits its head (pretraining_tp > 1)")
    if getattr(config, "output_router_logits", False):
        raise UnsupportedHead(f"{name}'s loss adds the router's auxiliary loss")
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise UnsupportedHead(f"{name} soft-caps its logits (not supported yet)")
    head = get_head()
    kind, what = head_kind(head)
    if kind is None:
        raise UnsupportedHead(f"{name}'s head: {what}")
    scale = getattr(model, "logit_scale", None)  # Cohere multiplies its logits by it
    if scale is not None and not isinstance(scale, (int, float)):
        raise UnsupportedHead(f"{name}'s logit_scale is a {type(scale).__name__}, not a number")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head.weight is getattr(embeddings, "weight", None)
    desc = f"{what}{', tied to the input embeddings' if tied else ''}"
    return head, scale, desc + (f", logit scale {scale}" if scale is not None else "")


def partitioned(head: nn.Module) -> bool:
    """True where DeepSpeed ZeRO-3 partitions the head's parameters (``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in head.parameters())


def head_call(head: nn.Module, loss_of: Callable, hidden: torch.Tensor) -> torch.Tensor:
    """``loss_of(hidden)`` (``[b, s, H] -> loss``) run as ``head(hidden)``, nested in one call of
    each module whose parameters it reads (``ops.chunked_loss.head_modules``), none per chunk:
    DeepSpeed ZeRO-3's hooks gather a module's parameters for its call (and, from its output's
    hook, for the backward) and free them after; the calls, the same on every rank, match the
    module order ZeRO-3 records and compares across ranks."""
    owners = [m for m in head_modules(head) if m is not head]
    for module in reversed([head, *owners]):
        loss_of = functools.partial(_as_call, module, loss_of)
    return loss_of(hidden)


def _as_call(module: nn.Module, loss_of: Callable, hidden: torch.Tensor) -> torch.Tensor:
    """``loss_of(hidden)`` as ``module(hidden)`` (its ``forward`` replaced for the call)."""
    own = vars(module).get("forward")
    module.forward = loss_of
    try:
        return module(hidden)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def is_chunked(llm: nn.Module) -> bool:
    """True if the causal LM of ``llm`` carries the chunked-loss ``forward``."""
    return _ORIGINAL in vars(causal_lm(llm))


def chunked_now(llm: nn.Module) -> bool:
    """True where ``llm``'s training loss is chunked now (patched, in :func:`loss_only`, not paused)."""
    model = causal_lm(llm)
    paused = getattr(model, "_xtuner_rope_paused", 0)
    return is_chunked(model) and _MODE.get() == "loss" and not paused


def patch_chunked_loss(llm: nn.Module, chunk_tokens: int | None = None) -> str:
    """Give the causal LM of ``llm`` (or of peft's ``PeftModel`` around it) the chunked training
    loss (idempotent); returns what runs, for the start-up log: the head and the chunk.

    Args:
        chunk_tokens: Tokens per chunk; default ``ops.chunked_loss.chunk_tokens_for(V)``.

    Raises:
        UnsupportedHead: see :func:`chunked_loss_head`; the model is left unpatched.
    """
    model = causal_lm(llm)
    head, scale, desc = chunked_loss_head(model)
    chunk = chunk_tokens or chunk_tokens_for(head.out_features)
    if _ORIGINAL not in vars(model):
        setattr(model, _ORIGINAL, model.forward)
    model._xtuner_rope_chunk = chunk

    # The model's own signature stays visible (``__wrapped__``): ``generate()`` reads it to pass
    # ``num_logits_to_keep`` (Phi-3's generation step fails with ``-None`` without it).
    def forward(self, *args, **kwargs):
        return _forward(self, *args, **kwargs)

    functools.update_wrapper(forward, type(model).forward)
    model.forward = types.MethodType(forward, model)
    return f"{desc}, vocabulary {head.out_features}, chunks of {chunk} supervised tokens"


def pause_chunked_loss(llm: nn.Module) -> Callable[[], None]:
    """The model's own loss and logits until the returned function is called (for what reads a
    training forward's logits); a model without the chunked loss is left as it is."""
    model = causal_lm(llm)
    if _ORIGINAL not in vars(model):
        return lambda: None
    model._xtuner_rope_paused = getattr(model, "_xtuner_rope_paused", 0) + 1

    def resume() -> None:
        model._xtuner_rope_paused -= 1

    return resume


def hidden_loss(
    llm: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    shifted: bool = False,
) -> torch.Tensor:
    """The chunked loss of the patched causal LM of ``llm`` on its last hidden states.

    Args:
        llm: The causal LM carrying the chunked loss (``patch_chunked_loss``), or peft's model.
        hidden: ``[b, s, H]`` its decoder's last hidden states.
        labels: ``[b, s]`` labels; ``shifted``: already the label each position predicts
            (sequence parallel's shards), else the model's own shift applies.
        num_items_in_batch: The NLL sum's denominator, or None for the mean.

    Returns:
        The fp32 scalar loss (``ops.chunked_loss.chunked_causal_lm_loss``), through the head's
        module calls under ZeRO-3 (:func:`head_call`).
    """
    options = dict(num_items_in_batch=num_items_in_batch, shifted=shifted)
    return _through_head(causal_lm(llm), chunked_causal_lm_loss, hidden, labels, **options)


def _through_head(model, op: Callable, hidden, labels, **options) -> torch.Tensor:
    """``op(hidden, labels, head, ...)`` with the patched model's head, scale and chunk, run
    as the head's module calls where ZeRO-3 partitions it (:func:`head_call`)."""
    # No parameter read here: in a ZeRO-3 forward, a partitioned one read outside its module's
    # call is gathered and registered with the LM, which then holds it for its whole step.
    head, scale = model.get_output_embeddings(), getattr(model, "logit_scale", None)

    def run(h: torch.Tensor) -> torch.Tensor:
        return op(
            h, labels, head, logit_scale=scale, chunk_tokens=model._xtuner_rope_chunk, **options
        )

    return head_call(head, run, hidden) if partitioned(head) else run(hidden)


def _forward(self, *args, **kwargs):
    own = getattr(self, _ORIGINAL)
    labels = kwargs.get("labels")
    mode = _MODE.get()
    if args or labels is None or mode is None or kwargs.get("return_dict") is False:
        return own(*args, **kwargs)
    if getattr(self, "_xtuner_rope_paused", 0):
        return own(*args, **kwargs)
    kwargs.pop("labels")
    kwargs.pop("return_dict", None)  # the decoder's output is read by name below
    n_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("num_logits_to_keep", None)
    outputs = self.get_decoder()(**kwargs, return_dict=True)
    hidden = outputs.last_hidden_state
    loss = logits = None
    if mode == "logprobs":  # DPO/ORPO, every served model's held-out predict
        logits = _through_head(self, chunked_target_logprobs, hidden, labels)[..., None]
    else:
        loss = hidden_loss(self, hidden, labels, num_items_in_batch=n_items)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kept = {k: getattr(outputs, k) for k in ("past_key_values", "hidden_states", "attentions")}
    return CausalLMOutputWithPast(loss=loss, logits=logits, **kept)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` the id position ``t`` predicts (``labels[:, t + 1]``, -100 at the last), with
    the labels' host copy shifted alike so the chunked log-probs read no device data."""
    pad = torch.nn.functional.pad
    targets = pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    host = host_copy(labels)
    if host is not None and targets.device != host.device:
        remember_host_copy(targets, pad(host[:, 1:], (0, 1), value=IGNORE_INDEX))
    return targets
