"""The doctor's logits memory: what one row of ``max_length`` tokens costs the training loss.

Full logits: ``s * V * 12`` bytes in any dtype. Chunked: the head's fp32 weight gradient
``V * H * 4`` (none under LoRA) plus the larger of one chunk ``c * V * (4 + d)`` and that
gradient's copy in the training dtype (docs/loss.md derives both).
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.config.checkpoint_findings import llm_checkpoint_config
from xtuner_rope.config.fields import lazy_get, type_name
from xtuner_rope.config.loss import CHUNKED_LOSS_KEY, DIALOGUE, LOSS_NORMALIZATION_KEY
from xtuner_rope.doctor.checkpoint_space import size_text
from xtuner_rope.ops.chunked_loss import chunk_tokens_for

__all__ = ["logits_memory", "logits_memory_lines"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _why_full(cfg: Config, plugin: bool) -> str | None:
    """Why the config's run keeps the full logits, or None when it trains on the chunked loss."""
    raw = config_dict(cfg)
    if raw.get(CHUNKED_LOSS_KEY, True) is False:
        return f"the config opts out ({CHUNKED_LOSS_KEY} = False)"
    if not plugin:
        return "the plugin is not enabled"
    model = type_name(lazy_get(raw.get("model"), "type"))
    if model != "SupervisedFinetune":
        return f"{model}'s loss is not served by the chunked loss yet"
    if raw.get(LOSS_NORMALIZATION_KEY) == DIALOGUE:
        return f'{LOSS_NORMALIZATION_KEY} = "{DIALOGUE}" weighs dialogues from the full logits'
    return None


def logits_memory(cfg: Config, max_length: object, plugin: bool) -> dict | None:
    """The loss's logits bytes for one row of ``max_length`` tokens, full and chunked.

    Args:
        max_length: Tokens of the longest row the run trains on (None: no figures).
        plugin: Whether the config enables xtuner-rope.

    Returns:
        None when ``max_length`` or the checkpoint's ``vocab_size`` / ``hidden_size`` is unknown,
        else ``tokens``, ``vocab``, ``hidden``, ``dtype``, ``full_bytes``, ``chunk_tokens``,
        ``chunk_bytes``, ``head_grad_bytes`` (0 under LoRA), ``chunked_bytes`` (the chunked
        loss's peak) and ``full_because`` (why the run keeps the full logits, None when the
        chunked loss runs).
    """
    checkpoint = llm_checkpoint_config(cfg)
    vocab = checkpoint.get("vocab_size") if checkpoint else None
    hidden = checkpoint.get("hidden_size") if checkpoint else None
    if not all(isinstance(x, int) and x > 0 for x in (max_length, vocab, hidden)):
        return None
    model = lazy_get(config_dict(cfg), "model")
    dtype = str(lazy_get(lazy_get(model, "llm"), "torch_dtype", "float32"))
    dtype = (
        dtype.removeprefix("torch.") if dtype.removeprefix("torch.") in DTYPE_BYTES else "float32"
    )
    d = DTYPE_BYTES[dtype]
    extra = 0 if d == 4 else d  # an fp32 head's output is its own fp32 copy
    setting = config_dict(cfg).get(CHUNKED_LOSS_KEY, True)
    chunk = setting if type(setting) is int else chunk_tokens_for(vocab)
    chunk = min(chunk, max_length)  # a chunk holds supervised tokens of the row at most
    grad = 0 if lazy_get(model, "lora") else vocab * hidden * 4  # the head's fp32 gradient
    return {
        "tokens": max_length,
        "vocab": vocab,
        "hidden": hidden,
        "dtype": dtype,
        "full_bytes": max_length * vocab * 12,
        "chunk_tokens": chunk,
        "chunk_bytes": chunk * vocab * (4 + extra),
        "head_grad_bytes": grad,
        "chunked_bytes": grad + max(chunk * vocab * (4 + extra), grad // 4 * extra),
        "full_because": _why_full(cfg, plugin),
    }


def logits_memory_lines(fig: dict | None) -> list[str]:
    """The summary line (none when the figures are unknown)."""
    if not fig:
        return []
    grad = fig["head_grad_bytes"]
    runs = (
        "this run trains on the chunked loss"
        if fig["full_because"] is None
        else f"this run keeps the full logits: {fig['full_because']}"
    )
    return [
        f"logits       a row of {fig['tokens']} tokens x vocabulary {fig['vocab']} "
        f"({fig['dtype']}): full-logits loss {size_text(fig['full_bytes'])}, chunked loss "
        f"{size_text(fig['chunked_bytes'])} at its peak (chunks of {fig['chunk_tokens']} "
        f"tokens: {size_text(fig['chunk_bytes'])}"
        + (f"; the head's fp32 weight gradient: {size_text(grad)}" if grad else "")
        + f"); {runs}"
    ]
