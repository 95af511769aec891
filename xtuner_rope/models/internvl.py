"""XTuner's InternVL models: where the LLM is, and what an image becomes for it.

``InternVL_V1_5`` (xtuner 0.2.0) writes the vision tokens over the ``<IMG_CONTEXT>`` ids before
the LLM: the sequence is the collate's, so the text path's attention patch serves it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["internvl_chat_model", "internvl_image_tokens", "llm_computes_the_loss"]


def internvl_chat_model(model: nn.Module) -> nn.Module | None:
    """The chat model inside XTuner's ``InternVL_V1_5`` (unwrapped), or None."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    inner = getattr(model, "model", None)
    if type(model).__name__ == "InternVL_V1_5" and hasattr(inner, "language_model"):
        return inner
    return None


def internvl_image_tokens(model: nn.Module) -> tuple[int, int] | None:
    """``(img_context_token_id, num_image_token)`` of an InternVL model, else None."""
    chat = internvl_chat_model(model)
    if chat is None or getattr(chat, "img_context_token_id", None) is None:
        return None
    return int(chat.img_context_token_id), int(chat.num_image_token)


@contextmanager
def llm_computes_the_loss(chat: nn.Module, labels: torch.Tensor) -> Iterator[dict]:
    """Inside: the next call of ``chat.language_model`` also gets ``labels``; its output is kept.

    For ``InternVL_V1_5.forward`` with ``labels=None``: the yielded ``"output"`` carries the
    LLM's own loss (a chunked-loss LLM then returns no logits). ``chat``:
    :func:`internvl_chat_model`; ``labels``: ``[b, s]``, aligned with the ids.
    """
    got: dict = {}
    llm = chat.language_model

    def give(module, args, kwargs):
        given.remove()  # the training call only: a hook may call the LLM again inside it
        return args, {**kwargs, "labels": labels}

    def keep(module, args, kwargs, output):
        if kwargs.get("labels") is labels:
            got["output"] = output

    given = llm.register_forward_pre_hook(give, with_kwargs=True)
    kept = llm.register_forward_hook(keep, with_kwargs=True)
    try:
        yield got
    finally:
        given.remove()
        kept.remove()
