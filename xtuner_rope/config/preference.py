"""Start-up findings for XTuner's preference configs (DPO, ORPO, reward model).

:func:`preference_findings` refuses, before the model loads, a ``reward_token_id`` outside the
vocabulary, ``batch_size`` > 1 with packed pairs, ``use_varlen_attn`` differing between model,
dataset and collate function, and full-parameter DPO without ``ref_llm`` under ZeRO-3.
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.compat.mmengine_config import config_dict

from .checkpoint_findings import llm_checkpoint_config
from .fields import lazy_get as _get
from .fields import type_name
from .findings import Finding
from .startup import register_findings

PREFERENCE_DATASET = "build_preference_dataset"
PREFERENCE_MODELS = ("DPO", "ORPO", "RewardModel")
# The edit that gives DPO under ZeRO-3 a reference model of its own (built partitioned).
ZERO3_REFERENCE_EDIT = (
    "set model.ref_llm = dict(type=AutoModelForCausalLM.from_pretrained, "
    "pretrained_model_name_or_path=pretrained_model_name_or_path, "
    "trust_remote_code=True), the same dict as model.llm"
)


def preference_dataset(cfg: Config, loader: str = "train_dataloader") -> dict | None:
    """The ``loader``'s dataset dict if it is XTuner's ``build_preference_dataset``, else None."""
    dataset = _get(_get(config_dict(cfg), loader), "dataset")
    return dataset if type_name(_get(dataset, "type")) == PREFERENCE_DATASET else None


def checkpoint_vocab_size(cfg: Config) -> tuple[int | None, str]:
    """``(vocab_size, file)`` of the local checkpoint the model loads, or ``(None, "")``."""
    config = llm_checkpoint_config(cfg)
    if config is None or config.data is None:
        return None, ""
    vocab = config.get("vocab_size")
    return (vocab, config.source) if isinstance(vocab, int) else (None, "")


def _reward_token_finding(cfg: Config, dataset: dict) -> list[Finding]:
    if not _get(dataset, "is_reward"):
        return []
    token = _get(dataset, "reward_token_id", -1)
    vocab, source = checkpoint_vocab_size(cfg)
    if not isinstance(token, int) or vocab is None or 0 <= token < vocab:
        return []
    where = (
        "reward_token_id (PART 1; train_dataloader.dataset.reward_token_id)"
        if "reward_token_id" in config_dict(cfg)
        else "train_dataloader.dataset.reward_token_id"
    )
    return [
        Finding(
            where,
            f"{token} is outside the vocabulary of the model being trained (vocab_size "
            f"{vocab}, from {source}): every pair ends with this token, so the first batch would "
            "be refused (by a message about input_ids) after the model has loaded",
            f"set reward_token_id to an id in 0..{vocab - 1} that this tokenizer reserves and never "
            "produces (the stock 92527 is InternLM2's [UNUSED_TOKEN_130]; use the counterpart in "
            "this vocabulary)",
        )
    ]


def _varlen_flags(cfg: Config, dataset: dict, key: str) -> dict[str, object]:
    collate = _get(_get(config_dict(cfg), key), "collate_fn")
    flags = {f"{key}.dataset.use_varlen_attn": bool(_get(dataset, "use_varlen_attn"))}
    if type_name(_get(collate, "type")) == "preference_collate_fn":
        flags[f"{key}.collate_fn.use_varlen_attn"] = bool(_get(collate, "use_varlen_attn"))
    model = _get(config_dict(cfg), "model")
    if type_name(_get(model, "type")) in PREFERENCE_MODELS:
        flags["model.use_varlen_attn"] = bool(_get(model, "use_varlen_attn"))
    return flags


def packed_pairs_findings(
    cfg: Config, dataset: dict, key: str = "train_dataloader"
) -> list[Finding]:
    """Varlen switches that disagree, or packed pairs at a batch size above 1, in ``key``
    (``train_dataloader``, or ``val_dataloader`` for held-out pairs; ``dataset`` its
    ``build_preference_dataset`` dict).
    """
    flags = _varlen_flags(cfg, dataset, key)
    if len(set(flags.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in flags.items())
        return [
            Finding(
                "use_varlen_attn",
                f"packed preference pairs need the same use_varlen_attn on the "
                f"model, the dataset and the collate function, got {listed}: the collate function "
                "fails (KeyError) or the model takes chosen/rejected log-probs from the wrong rows",
                "set use_varlen_attn = True (packed pairs) or False in PART 1 and pass that one "
                "variable to all three",
            )
        ]
    batch_size = _get(_get(config_dict(cfg), key), "batch_size", 1)
    if not flags[f"{key}.dataset.use_varlen_attn"] or batch_size == 1:
        return []
    return [
        Finding(
            f"{key}.batch_size",
            f"{batch_size}: packed preference pairs "
            "(use_varlen_attn=True) take one packed row per batch; XTuner's preference_collate_fn "
            "asserts batch size 1 at the first batch, after the model has loaded",
            "set batch_size = 1 in PART 1: a packed row already holds several pairs (raise "
            "max_packed_length for more pairs per row, or accumulative_counts for more per step)",
        )
    ]


def _zero3_reference_finding(cfg: Config) -> list[Finding]:
    """Full-parameter DPO under DeepSpeed ZeRO-3: XTuner cannot copy the reference model."""
    model = _get(config_dict(cfg), "model")
    if (
        type_name(_get(model, "type")) != "DPO"
        or _get(model, "ref_llm") is not None
        or _get(model, "lora") is not None
    ):
        return []
    from .launch import deepspeed_zero_stage

    if deepspeed_zero_stage(cfg) != 3:
        return []
    return [
        Finding(
            "model.ref_llm (DPO) with DeepSpeed ZeRO-3",
            "None: XTuner's DPO then makes the "
            "reference model with create_reference_model (a deepcopy of the policy), which raises "
            "'DeepSpeed ZeRO-3 is enabled and is not compatible with create_reference_model()' "
            "after the policy's weights are loaded (a deepcopy of ZeRO-3-partitioned weights "
            "would copy empty shards)",
            f"{ZERO3_REFERENCE_EDIT}, or train DPO with ZeRO-2 (--deepspeed "
            "configs/deepspeed/zero2_fp32_cpu.json on CPU, deepspeed_zero2 on a GPU)",
        )
    ]


@register_findings("preference")
def preference_findings(cfg: Config) -> list[Finding]:
    """Conflicts of a preference config that XTuner would report late or never (no fixes: each needs
    the user's choice); empty for other configs.
    """
    dataset = preference_dataset(cfg)
    if dataset is None:
        return []
    return (
        _reward_token_finding(cfg, dataset)
        + packed_pairs_findings(cfg, dataset)
        + _zero3_reference_finding(cfg)
    )


__all__ = [
    "PREFERENCE_MODELS",
    "checkpoint_vocab_size",
    "packed_pairs_findings",
    "preference_dataset",
    "preference_findings",
]
