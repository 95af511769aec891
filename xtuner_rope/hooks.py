"""MMEngine hooks: thin glue between the runner and xtuner_rope's attention / validation code."""

from __future__ import annotations

from typing import Optional, Union

import torch
from mmengine import MessageHub
from mmengine.dist import get_rank
from mmengine.hooks import Hook
from mmengine.logging import print_log
from torch import nn

from .attention import (
    CUMULATIVE_KEY,
    INTERNLM2_ATTENTION_CLASSES,
    MAX_SEQLEN_KEY,
    VARLEN_HUB,
    internlm2_attention_forward,
    patch_internlm2_attention,
)
from .packing import flat_cumulative
from .rope import ValidatedRotaryEmbedding, use_fused_apply
from .validate import check_packed_batch, row_boundaries

DATA_BATCH = Optional[Union[dict, tuple, list]]


def isolates_documents(model: nn.Module) -> bool:
    """True if every attention layer of ``model`` is InternLM2's and carries our patch."""
    layers = [m for m in model.modules() if "Attention" in type(m).__name__
              and hasattr(m, "rotary_emb")]
    return bool(layers) and all(
        type(m).__name__ in INTERNLM2_ATTENTION_CLASSES
        and getattr(m.forward, "__func__", None) is internlm2_attention_forward for m in layers)


def _unwrap(model: nn.Module) -> nn.Module:
    """The module holding the HF model: through DDP/DeepSpeed ``.module`` and XTuner's ``.llm``."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return getattr(model, "llm", model)


class ValidatedRoPEHook(Hook):
    """Swap every InternLM2 attention layer to the validated fp32 RoPE and packed attention.

    Runs before training, validation and testing (idempotent), after the runner has wrapped
    the model, so DDP / DeepSpeed / PEFT wrappers are covered.

    Args:
        max_position: Optional override of the largest position the RoPE accepts.
        fused_apply: Rotate q/k with the fused ``torch.compile`` kernel (process-wide, see
            ``xtuner_rope.rope.use_fused_apply``): fewer memory passes, a few seconds of
            compiling at the first step, the eager kernel again if compiling fails.
    """

    # Before every default hook (RuntimeInfo is 10): the model is patched before anything runs it.
    priority = 5

    def __init__(self, max_position: int | None = None, fused_apply: bool = False) -> None:
        self.max_position = max_position
        self.fused_apply = fused_apply

    def _patch(self, runner) -> None:
        count = patch_internlm2_attention(runner.model, max_position=self.max_position)
        rotary = next(m for m in runner.model.modules() if isinstance(m, ValidatedRotaryEmbedding))
        limit, why = rotary.limit()
        if self.fused_apply:
            use_fused_apply(True)
        kernel = "fused (torch.compile)" if self.fused_apply else "eager"
        print_log(f"ValidatedRoPEHook: {count} InternLM2 attention layers use the validated fp32 "
                  f"RoPE ({kernel} kernel) and document-isolating attention; positions must be "
                  f"< {limit} ({why}).", logger="current")

    def before_train(self, runner) -> None:
        self._patch(runner)

    def before_val(self, runner) -> None:
        self._patch(runner)

    def before_test(self, runner) -> None:
        self._patch(runner)


class PackedBatchCheckHook(Hook):
    """Check every train/val batch on the CPU, then publish its document boundaries.

    Before each iteration it runs ``check_packed_batch`` on ``data_batch['data']`` (shapes,
    boundaries, positions, RoPE range, label range, at least one supervised token), then pops
    ``cumulative_len`` and ``max_seqlen`` from it, because the HF model's ``forward`` does not
    take them, and publishes them in ``MessageHub.get_instance('varlen_attn_args')`` under
    ``cumulative_len_rank_{rank}`` / ``max_seqlen_rank_{rank}`` (XTuner's convention), as one
    flat int32 tensor of boundaries over the ``[b * s]`` tokens. Both keys are reset to None in
    ``after_train_iter`` / ``after_val_iter``.

    Args:
        vocab_size: Label/id limit; default: the model config's ``vocab_size``.
        max_position: RoPE range; default: the validated RoPE's limit (after
            ``ValidatedRoPEHook``), else the config's ``max_position_embeddings``.
    """

    # After ValidatedRoPEHook (5), before every default hook and before XTuner's
    # EvaluateChatHook ('LOW', 70), so the boundaries are reset before it generates.
    priority = 8

    def __init__(self, vocab_size: int | None = None, max_position: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_position = max_position
        self._isolating: bool | None = None
        self._checked_limits: tuple[int | None, int | None] | None = None

    def _inspect_model(self, runner) -> None:
        """Once per run/val loop, not per batch: what the model isolates and accepts."""
        self._isolating = isolates_documents(runner.model)
        self._checked_limits = self._limits(runner)

    def before_train(self, runner) -> None:
        self._inspect_model(runner)

    def before_val(self, runner) -> None:
        self._inspect_model(runner)

    def _refuse_leaky_packing(self, data: dict, rows: list[torch.Tensor]) -> None:
        """Packed rows on an unpatched model attend across documents: refuse, don't train."""
        if self._isolating or "attention_mask" in data:
            return
        packed = [r for r, row in enumerate(rows) if len(row) > 2]
        if packed:
            raise ValueError(
                f"PackedBatchCheckHook: batch row {packed[0]} packs {len(rows[packed[0]]) - 1} "
                "segments, but the model's attention does not isolate documents (documents would "
                "silently attend to each other). Add dict(type=ValidatedRoPEHook) to custom_hooks "
                "(it patches InternLM2 attention), or collate with pack=False.")

    def _limits(self, runner) -> tuple[int | None, int | None]:
        config = getattr(_unwrap(runner.model), "config", None)
        vocab = self.vocab_size or getattr(config, "vocab_size", None)
        if self.max_position is not None:
            return vocab, self.max_position
        rotary = next((m for m in runner.model.modules()
                       if isinstance(m, ValidatedRotaryEmbedding)), None)
        if rotary is not None:
            return vocab, rotary.limit()[0]
        return vocab, getattr(config, "max_position_embeddings", None)

    def _check_and_publish(self, runner, data_batch: DATA_BATCH) -> None:
        if not isinstance(data_batch, dict) or not isinstance(data_batch.get("data"), dict):
            raise TypeError("PackedBatchCheckHook expects XTuner batches {'data': {...}, "
                            f"'data_samples': ...}}, got {type(data_batch).__name__}; use "
                            "rope_collate_fn or XTuner's default_collate_fn.")
        data = data_batch["data"]
        if self._checked_limits is None:
            self._inspect_model(runner)
        vocab, max_position = self._checked_limits
        check_packed_batch(data, vocab_size=vocab, max_position=max_position)
        b, s = data["input_ids"].shape
        rows = row_boundaries(data, b) if data.get("cumulative_len") is not None else []
        self._refuse_leaky_packing(data, rows)
        data.pop("cumulative_len", None)
        data.pop("num_unsupervised", None)  # counted by rope_collate_fn; the HF forward rejects it
        max_seqlen = data.pop("max_seqlen", None)
        if not rows:
            return
        flat = flat_cumulative(rows, s)
        hub = MessageHub.get_instance(VARLEN_HUB)
        hub.update_info(CUMULATIVE_KEY.format(rank=get_rank()), flat)
        hub.update_info(MAX_SEQLEN_KEY.format(rank=get_rank()), max_seqlen)

    @staticmethod
    def _reset() -> None:
        hub = MessageHub.get_instance(VARLEN_HUB)
        hub.update_info(CUMULATIVE_KEY.format(rank=get_rank()), None)
        hub.update_info(MAX_SEQLEN_KEY.format(rank=get_rank()), None)

    def before_train_iter(self, runner, batch_idx: int, data_batch: DATA_BATCH = None) -> None:
        self._check_and_publish(runner, data_batch)

    def before_val_iter(self, runner, batch_idx: int, data_batch: DATA_BATCH = None) -> None:
        self._check_and_publish(runner, data_batch)

    def after_train_iter(self, runner, batch_idx: int, data_batch: DATA_BATCH = None,
                         outputs: Optional[dict] = None) -> None:
        self._reset()

    def after_val_iter(self, runner, batch_idx: int, data_batch: DATA_BATCH = None,
                       outputs=None) -> None:
        self._reset()
