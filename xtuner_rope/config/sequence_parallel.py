"""Start-up findings of sequence parallel: the size itself, and the LLM's head counts.

``sequence_parallel_size`` is served for SFT (``models.sequence_parallel``), refused for the
other models; ``default_collate_fn`` becomes ``rope_collate_fn`` padded to a multiple of it. On
a CPU-only machine ``sp`` not dividing the heads, or a gloo without all-to-all, is refused.
"""

from __future__ import annotations

from mmengine.config import Config
from mmengine.config.lazy import LazyObject

from xtuner_rope.compat.devices import cpu_only, gloo_all_to_all_missing
from xtuner_rope.compat.mmengine_config import config_dict

from .checkpoint_findings import llm_checkpoint_config
from .fields import lazy_get as _get
from .fields import type_name
from .findings import Finding
from .startup import register_findings

__all__ = [
    "checkpoint_heads",
    "heldout_collate_findings",
    "sequence_parallel_heads_findings",
    "sequence_parallel_size_findings",
]


def checkpoint_heads(cfg: Config) -> tuple[str, int | None]:
    """``(config.json source, num_attention_heads)`` of the LLM's checkpoint (None: unknown,
    e.g. a ``config.json`` that cannot be read, refused by ``config.checkpoint_findings``)."""
    config = llm_checkpoint_config(cfg)
    if config is None or config.data is None:
        return "", None
    heads = config.get("num_attention_heads")
    return config.source, heads if isinstance(heads, int) else None


@register_findings("sequence_parallel")
def sequence_parallel_heads_findings(cfg: Config) -> list[Finding]:
    """Refuse sequence parallel on a CPU-only machine where it cannot run: with a
    ``sequence_parallel_size`` not dividing the heads (that edit first), else over a gloo
    without ``all_to_all`` (torch 2.4.1)."""
    sp = config_dict(cfg).get("sequence_parallel_size", 1)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp <= 1 or not cpu_only():
        return []  # a bad size is refused by sequence_parallel_size_findings
    where, heads = checkpoint_heads(cfg)
    if heads is not None and heads % sp:  # first: the edit of the size itself
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        return [
            Finding(
                "sequence_parallel_size",
                f"{sp} does not divide the {heads} attention heads (from "
                f"{where}): XTuner's inner sequence parallel, its fallback for that, gathers "
                "through gather_for_sequence_parallel, which refuses CPU tensors (xtuner 0.2.0) "
                "after the weights are loaded",
                f"set sequence_parallel_size to a divisor of {heads} "
                f"({', '.join(map(str, divisors))}), or train on GPUs",
            )
        ]
    missing = gloo_all_to_all_missing()
    if not missing:
        return []
    return [
        Finding(
            "sequence_parallel_size",
            f"{sp} on a CPU-only machine: XTuner's sequence parallel exchanges heads and "
            f"tokens with all_to_all, which runs over gloo here, and {missing}",
            "set sequence_parallel_size = 1, or install a torch whose gloo has all_to_all "
            "(2.14.1 and 2.15.0 have it) with its own torchvision, or train on GPUs (NCCL)",
        )
    ]


def sequence_parallel_size_findings(cfg: Config) -> list[Finding]:
    """``sequence_parallel_size``: served for SFT (``models.sequence_parallel``), else refused;
    heads it does not divide are served on GPUs (XTuner's inner sequence parallel), refused on a
    CPU-only machine from ``config.json``."""
    sp = _get(config_dict(cfg), "sequence_parallel_size", 1)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        return [
            Finding(
                "sequence_parallel_size",
                f"{sp!r} is not a positive int",
                "set sequence_parallel_size = 1 (off) or the number of ranks per row",
            )
        ]
    model = type_name(_get(_get(config_dict(cfg), "model"), "type"))
    if sp > 1 and model != "SupervisedFinetune":
        return [
            Finding(
                "sequence_parallel_size",
                f"{sp} with model type {model}: xtuner-rope serves "
                "sequence parallel for SupervisedFinetune (SFT) only; XTuner's DPO/ORPO/reward "
                "sequence-parallel paths are not wired to its packed attention",
                "set sequence_parallel_size = 1 for this model",
            )
        ]
    collate = _get(_get(config_dict(cfg), "train_dataloader"), "collate_fn")
    if (
        sp == 1
        or not isinstance(collate, dict)
        or (type_name(_get(collate, "type")) != "default_collate_fn")
    ):
        return []

    def use_ours() -> None:
        collate["type"] = LazyObject("xtuner_rope.data.collate", "rope_collate_fn")
        collate["pad_to_multiple_of"] = sp

    return [
        Finding(
            "train_dataloader.collate_fn",
            f"default_collate_fn asserts that packed rows divide by "
            f"sequence_parallel_size={sp} (XTuner pads only rows without boundaries)",
            f"set to rope_collate_fn (same arguments) with pad_to_multiple_of={sp}: rows padded by "
            "a segment of their own",
            use_ours,
        )
    ]


def heldout_collate_findings(loader: dict, sp: int) -> list[Finding]:
    """Under sequence parallel, XTuner's ``default_collate_fn`` asserts packed rows divide by
    ``sp`` (xtuner 0.2.0); held-out rows hold whole dialogues. ``rope_collate_fn`` keeps them
    as they are: evaluation runs whole rows, each rank its own (no split, no padding)."""
    collate = _get(loader, "collate_fn")

    def use_ours() -> None:
        kwargs = dict(collate) if isinstance(collate, dict) else {}
        kwargs.update(type=LazyObject("xtuner_rope.data.collate", "rope_collate_fn"))
        kwargs["use_varlen_attn"] = True
        loader["collate_fn"] = kwargs

    return [
        Finding(
            "val_dataloader.collate_fn",
            f"default_collate_fn asserts that packed rows divide by sequence_parallel_size={sp}; "
            "the held-out rows hold whole dialogues of any length",
            "set to rope_collate_fn (same arguments, use_varlen_attn=True): each held-out row is "
            "evaluated whole, by one rank",
            use_ours,
        )
    ]
