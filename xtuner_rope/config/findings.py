"""What a start-up finding is, and where it goes in the report: the start-up's vocabulary.

:class:`Finding`, :class:`ConfigConflict` (the refusal), :func:`conflict_message` (its text),
and :data:`SLOTS`, where the findings modules register (``startup.register_findings``); the
engine, ``config.startup``, re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "MODEL_RESOURCE_EDIT",
    "SLOTS",
    "ConfigConflict",
    "Finding",
    "conflict_message",
    "slot_rank",
]

MODEL_RESOURCE_EDIT = (
    "add to PART 1 of the config:\n"
    "    from xtuner_rope import enable_xtuner_rope\n"
    "    model_resource = dict(fn=enable_xtuner_rope)"
)


class ConfigConflict(ValueError):
    """Settings of an XTuner config that would make training fail or silently wrong."""


@dataclass
class Finding:
    """One setting the plugin must change (``fix`` set) or refuse (``fix`` None).

    Attributes:
        setting: Where it is, in config terms (``train_dataloader.collate_fn``).
        problem: What goes wrong with it.
        edit: The exact edit a user makes (for a conflict), or what the fix did (for a fix).
        fix: Applies the change to the config in place; None for a conflict.
    """

    setting: str
    problem: str
    edit: str
    fix: Callable[[], None] | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"{self.setting}: {self.problem}\n  -> {self.edit}"


# Where each topic's findings appear in the start-up's report and are applied, first to last.
SLOTS = (
    "patches",  # config.patch_needs: a feature whose third-party patch was skipped here
    "varlen",  # config.packing: the stock use_varlen_attn switch
    "framework",  # config.frameworks: XTuner's Hugging Face Trainer configs
    "packing",  # config.packing: boundaries recorded and kept, nothing dropped
    "loss",  # config.loss: loss_normalization
    "multimodal",  # config.multimodal: LLaVA's LLM
    "internvl",  # config.internvl: InternVL_V1_5 (LLM attention, fp32 on CPU, 4-bit, collate)
    "llava_tower",  # config.llava_tower: image_tokens and crop size against the vision tower
    "launch",  # config.launch: DeepSpeed, launcher, devices
    "checkpoint_saving",  # config.accumulation, config.optimizer_state: what and when CheckpointHook saves
    "sequence_parallel",  # config.sequence_parallel: heads not divisible on CPU
    "rope_scaling",  # config.rope_scaling: a rope_scaling no model can compute
    "hooks",  # config.runtime: the plugin's hooks in custom_hooks
    "runtime",  # config.runtime: AMP on CPU, sequence_parallel_size
    "heldout",  # config.heldout: the held-out rows as the train rows, TokenLossMetric
    "attention",  # config.families: flash_attention_2 where flash-attn cannot run
    "family",  # config.families: unserved families
    "llm_checkpoint",  # config.checkpoint_findings: the LLM checkpoint's unreadable config.json
    "preference",  # config.preference: DPO, ORPO, reward model
)


def slot_rank(slot: str) -> int:
    """The place of ``slot`` in the report (its index in :data:`SLOTS`); ValueError for no slot."""
    if slot not in SLOTS:
        raise ValueError(
            f"register_findings: unknown slot {slot!r}; use one of {', '.join(SLOTS)} "
            "(xtuner_rope.config.findings.SLOTS), or add a slot there"
        )
    return SLOTS.index(slot)


def conflict_message(conflicts: list[Finding]) -> str:
    """One error text listing every conflict with the edit that resolves it."""
    items = "\n".join(f"{i}. {c}" for i, c in enumerate(conflicts, 1))
    return (
        f"xtuner-rope: {len(conflicts)} setting(s) of this config would make training fail "
        f"or silently wrong; edit the config and start again:\n{items}"
    )
