"""MMEngine hooks: thin glue between the runner and xtuner_rope's attention / validation code.

``enable_xtuner_rope`` (the config's ``model_resource``, see ``xtuner_rope.config.startup``) adds both
hooks to ``custom_hooks``; list them yourself only to pass arguments.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from mmengine.hooks import Hook
from mmengine.logging import print_log

from xtuner_rope import compat
from xtuner_rope.batch.checks import batch_data, row_boundaries
from xtuner_rope.batch.images import check_batch_with_images
from xtuner_rope.batch.internvl_tiles import check_image_context
from xtuner_rope.batch.sequence_parallel import check_sequence_parallel_rows
from xtuner_rope.compat import xtuner_llava
from xtuner_rope.config.fields import packing_source
from xtuner_rope.config.overrides import recheck_started_config
from xtuner_rope.config.startup import require_prepared
from xtuner_rope.hooks.chunked_loss import enable_chunked_loss
from xtuner_rope.hooks.train_data import check_train_data
from xtuner_rope.models import channel
from xtuner_rope.models.dispatch import (
    VALIDATED_ROTARIES,
    isolates_documents,
    language_model,
    patch_model,
)
from xtuner_rope.models.internvl import internvl_image_tokens
from xtuner_rope.models.rope_documents import per_document_rope_setting
from xtuner_rope.models.sequence_parallel import sequence_parallel_size
from xtuner_rope.ops.packing import flat_cumulative
from xtuner_rope.ops.rope import use_fused_apply

DATA_BATCH = Optional[Union[dict, tuple, list]]


class ValidatedRoPEHook(Hook):
    """Give the model the validated fp32 RoPE and document-isolating attention of its family.

    Runs before training, validation and testing (idempotent); refuses a model of no supported
    family, and a config ``enable_xtuner_rope`` did not prepare. ``max_position`` overrides the
    largest position the RoPE accepts; ``fused_apply``: ``use_fused_apply``.
    """

    # Before every default hook (RuntimeInfo is 10): the model is patched before anything runs it.
    priority = 5

    def __init__(self, max_position: int | None = None, fused_apply: bool = False) -> None:
        self.max_position = max_position
        self.fused_apply = fused_apply

    def _patch(self, runner) -> None:
        require_prepared(getattr(runner, "cfg", None), type(self).__name__)
        recheck_started_config(getattr(runner, "cfg", None), type(self).__name__)
        count, family = patch_model(runner.model, max_position=self.max_position)
        per_document_rope_setting(runner)
        rotary = next(m for m in runner.model.modules() if isinstance(m, VALIDATED_ROTARIES))
        limit, why = rotary.limit()
        if self.fused_apply:
            use_fused_apply(True)
        kernel = "fused (torch.compile)" if self.fused_apply else "eager"
        print_log(
            f"ValidatedRoPEHook: {count} {family} attention layers use the validated fp32 "
            f"RoPE ({kernel} kernel) and document-isolating attention; positions must be "
            f"< {limit} ({why}).",
            logger="current",
        )

    def before_train(self, runner) -> None:
        self._patch(runner)
        print_log(enable_chunked_loss(runner), logger="current")  # the training loss only

    def before_val(self, runner) -> None:
        self._patch(runner)

    def before_test(self, runner) -> None:
        self._patch(runner)


def refuse_unbounded_packing(data: dict, rows: list[torch.Tensor], packed_by: str | None) -> None:
    """Refuse a batch of rows the config packs (``packed_by``: ``fields.packing_source``) with no
    ``cumulative_len`` (``rows`` empty) and no position reset in ``data``: its dialogues would
    attend to each other.

    Raises:
        ValueError: ``packed_by`` is set and the batch has no boundary at all.
    """
    positions = data.get("position_ids")
    if packed_by is None or rows:
        return
    if (
        isinstance(positions, torch.Tensor)
        and positions.dim() == 2
        and bool((positions[:, 1:] == 0).any())
    ):
        return  # position resets: the patched attention isolates the documents
    raise ValueError(
        f"PackedBatchCheckHook: the rows of this batch are packed ({packed_by}) but reach the "
        "model without document boundaries (no cumulative_len, position ids one 0..s-1 range "
        "per row): the dialogues of a row would attend to each other. Keep the boundaries: "
        "set use_varlen_attn=True on default_collate_fn and on a process_hf_dataset (the "
        "intern-repo build_packed_dataset records them always; the start-up does "
        "it; drop any --cfg-options that sets them False), or collate with "
        "dict(type=rope_collate_fn, pack=True, max_length=max_length)."
    )


class PackedBatchCheckHook(Hook):
    """Check every train/val batch on the CPU, then publish its document boundaries.

    ``check_packed_batch`` runs on ``data_batch['data']``; ``cumulative_len`` and ``max_seqlen``
    are popped and published (``models.channel``), reset after the iteration. A packed train
    batch without boundaries, or one the sequence-parallel split cannot cut, stops the run.

    Args:
        vocab_size: Label/id limit; default: the model config's ``vocab_size``.
        max_position: RoPE range; default: the validated RoPE's limit, else the config's
            ``max_position_embeddings``.
    """

    # After ValidatedRoPEHook (5), before every default hook and before XTuner's
    # EvaluateChatHook ('LOW', 70), so the boundaries are reset before it generates.
    priority = 8

    def __init__(self, vocab_size: int | None = None, max_position: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_position = max_position
        self._isolating: bool | None = None
        self._reported = False
        self._checked_limits: tuple[int | None, int | None] | None = None
        self._packed_by: str | None = None

    def _inspect_model(self, runner) -> None:
        """Once per run/val loop, not per batch: what the model isolates and accepts."""
        self._isolating = isolates_documents(runner.model)
        self._checked_limits = self._limits(runner)
        self._reported = False
        compat.run_patch(
            xtuner_llava.patch_llava_expansion_check, runner.model, self._checked_limits[1]
        )
        self._internvl = internvl_image_tokens(runner.model)

    def _report_first_batch(self, rows: list[torch.Tensor], b: int, s: int) -> None:
        """One log line per loop: what the first batch holds, so a run shows its packing."""
        if self._reported:
            return
        self._reported = True
        segments = sum(len(row) - 1 for row in rows)
        how = (
            f"{segments} segments (documents and padding) isolated by the attention"
            if rows
            else "no document boundaries (plain padded rows)"
        )
        print_log(
            f"PackedBatchCheckHook: first batch {b} rows x {s} tokens, {how}.", logger="current"
        )

    def before_train(self, runner) -> None:
        self._inspect_model(runner)
        self._packed_by = packing_source(getattr(runner, "cfg", None))
        check_train_data(runner, self._checked_limits[1])  # LLaVA, preference: all samples

    def before_val(self, runner) -> None:
        self._inspect_model(runner)

    def _refuse_leaky_packing(self, data: dict, rows: list[torch.Tensor]) -> None:
        """Packed rows on an unpatched model attend across documents: refuse, don't train."""
        # Padded rows carry attention_mask; LLaVA rows always do (llava_collate_fn packs them).
        if self._isolating or "attention_mask" in data and data.get("pixel_values") is None:
            return
        packed = [r for r, row in enumerate(rows) if len(row) > 2]
        if packed:
            raise ValueError(
                f"PackedBatchCheckHook: batch row {packed[0]} packs {len(rows[packed[0]]) - 1} "
                "segments, but the model's attention does not isolate documents (documents would "
                "silently attend to each other). Add dict(type=ValidatedRoPEHook) to custom_hooks "
                "(the start-up through model_resource=dict(fn=enable_xtuner_rope) adds it), or "
                "collate with pack=False."
            )

    def _limits(self, runner) -> tuple[int | None, int | None]:
        config = getattr(language_model(runner.model), "config", None)
        vocab = self.vocab_size or getattr(config, "vocab_size", None)
        if self.max_position is not None:
            return vocab, self.max_position
        rotary = next(
            (m for m in runner.model.modules() if isinstance(m, VALIDATED_ROTARIES)), None
        )
        if rotary is not None:
            return vocab, rotary.limit()[0]
        return vocab, getattr(config, "max_position_embeddings", None)

    def _check_and_publish(
        self, runner, data_batch: DATA_BATCH, packed_by: str | None = None
    ) -> None:
        data = batch_data(data_batch, "PackedBatchCheckHook")
        if self._checked_limits is None:
            self._inspect_model(runner)
        vocab, max_position = self._checked_limits
        if getattr(self, "_internvl", None) is not None:  # ids hold the image tokens already
            check_image_context(data, *self._internvl)
            text = {k: v for k, v in data.items() if k != "pixel_values"}
            check_batch_with_images(text, vocab_size=vocab, max_position=max_position)
        else:
            check_batch_with_images(data, vocab_size=vocab, max_position=max_position)
        b, s = data["input_ids"].shape
        rows = row_boundaries(data, b) if data.get("cumulative_len") is not None else []
        self._refuse_leaky_packing(data, rows)
        refuse_unbounded_packing(data, rows, packed_by)
        self._report_first_batch(rows, b, s)
        data.pop("cumulative_len", None)
        data.pop("num_unsupervised", None)  # counted by rope_collate_fn; the HF forward rejects it
        max_seqlen = data.pop("max_seqlen", None)
        if not rows:
            return
        flat = flat_cumulative(rows, s)
        channel.publish(flat, max_seqlen)

    @staticmethod
    def _reset() -> None:
        channel.clear()

    def before_train_iter(self, runner, batch_idx: int, data_batch: DATA_BATCH = None) -> None:
        # Only the train loader's packing is read from the config (fields.packing_source).
        self._check_and_publish(runner, data_batch, self._packed_by)
        # Sequence parallel splits train rows only (batch.sequence_parallel).
        shape = tuple(batch_data(data_batch, "PackedBatchCheckHook")["input_ids"].shape)
        check_sequence_parallel_rows(
            shape, sequence_parallel_size(), pads_itself=bool(self._isolating)
        )

    def before_val_iter(self, runner, batch_idx: int, data_batch: DATA_BATCH = None) -> None:
        self._check_and_publish(runner, data_batch)

    def after_train_iter(
        self, runner, batch_idx: int, data_batch: DATA_BATCH = None, outputs: Optional[dict] = None
    ) -> None:
        self._reset()

    def after_val_iter(
        self, runner, batch_idx: int, data_batch: DATA_BATCH = None, outputs=None
    ) -> None:
        self._reset()
