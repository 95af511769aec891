"""XTuner's InternVL models: where the LLM is, and what an image becomes for it.

``InternVL_V1_5`` (xtuner 0.2.0) holds the checkpoint's chat model as ``.model`` (hub remote
code: ``vision_model``, ``mlp1``, ``language_model``, ``num_image_token``,
``img_context_token_id``). Its ``_llm_forward`` writes the vision tokens over the
``<IMG_CONTEXT>`` ids *before* the LLM: unlike LLaVA, the sequence (length, ``position_ids``,
``attention_mask``) is the one the collate function made, so the text path's attention patch
and boundaries serve it unchanged.
"""

from __future__ import annotations

from torch import nn

__all__ = ["internvl_chat_model", "internvl_image_tokens"]


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
