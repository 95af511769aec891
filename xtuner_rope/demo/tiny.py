"""Tiny checkpoints of every supported family (2 layers, hidden 64), deterministic and offline.

A byte-level BPE tokenizer trained on the shipped sample dialogues and a seeded model: XTuner's
own InternLM2 classes, transformers' for the others. ``python tools/make_tiny.py --family
mistral --out DIR`` writes one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

# InternLM2 chat special tokens. Ids 0-2 follow InternLM2's config defaults
# (pad_token_id=0, bos_token_id=1, eos_token_id=2); XTuner's collate pads with 0 too.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")

# hidden 64, 2 layers, GQA (4 query heads over 2 kv heads) so the kv-head path is exercised.
TINY_MODEL_KWARGS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=10000,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# ChatML, as InternLM2-chat formats dialogues (and as XTuner's ``internlm2_chat`` template does).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# transformers' class prefix of each family but InternLM2 (XTuner's shipped classes).
CLASS_PREFIX = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "mistral": "Mistral",
    "phi3": "Phi3",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2Moe",
    "gemma": "Gemma",
    "cohere": "Cohere",
}
FAMILIES = ("internlm2", *CLASS_PREFIX)

# Each family's quirk in its tiny model, on top of TINY_MODEL_KWARGS: MoE with 4 experts of
# which 2 route each token (Qwen2-MoE: plus its shared expert); Gemma's MQA (1 kv head) with
# head_dim 32 != hidden / heads and tied embeddings; Cohere's tied embeddings (qk-norm is the
# ``use_qk_norm`` override).
FAMILY_KWARGS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    ),
    "gemma": dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    "cohere": dict(tie_word_embeddings=True),
}


def iter_dialogue_texts(jsonl_path: str | Path | None = None) -> Iterator[str]:
    """Yield every message content of an OpenAI-messages JSONL file (None: the shipped sample
    dialogues), in file order."""
    if jsonl_path is None:
        from .sample_dialogues import sample_path

        jsonl_path = sample_path()
    with open(jsonl_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                for message in json.loads(line)["messages"]:
                    yield message["content"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of ``vocab_size`` (specials included) trained on
    ``texts`` (deterministic, no unknown token), with InternLM2's specials and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="right",
        model_max_length=TINY_MODEL_KWARGS["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny(family: str, vocab_size: int, seed: int = 0, **overrides):
    """A randomly initialised tiny ``ForCausalLM`` of ``family`` (:data:`FAMILIES`), fp32, eval mode.

    ``vocab_size``: ``len(tokenizer)``; ``seed``: the weights' (the global RNG is restored);
    ``overrides``: config fields replacing ``TINY_MODEL_KWARGS`` (e.g. ``rope_scaling``).

    Raises:
        ValueError: ``family`` is not one of :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise ValueError(f"build_tiny: family {family!r} is not one of {', '.join(FAMILIES)}.")
    if family == "internlm2":
        from xtuner._lite.modelings import internlm2 as classes

        prefix = "InternLM2"
    else:
        import transformers as classes

        prefix = CLASS_PREFIX[family]
    kwargs = {**TINY_MODEL_KWARGS, **FAMILY_KWARGS.get(family, {}), **overrides}
    config = getattr(classes, f"{prefix}Config")(vocab_size=vocab_size, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(classes, f"{prefix}ForCausalLM")(config)
    return model.eval()


def build_tiny_internlm2(vocab_size: int, seed: int = 0, **overrides):
    """:func:`build_tiny` of XTuner's shipped ``InternLM2ForCausalLM``."""
    return build_tiny("internlm2", vocab_size, seed=seed, **overrides)


def build_tiny_hf(family: str, vocab_size: int, seed: int = 0, **overrides):
    """:func:`build_tiny` of a transformers family (``ValueError`` for any other)."""
    if family not in CLASS_PREFIX:
        raise ValueError(f"build_tiny_hf: family {family!r} is not one of {sorted(CLASS_PREFIX)}.")
    return build_tiny(family, vocab_size, seed=seed, **overrides)


def save_tiny(
    out_dir: str | Path,
    family: str = "internlm2",
    dialogues_jsonl: str | Path | None = None,
    seed: int = 0,
    vocab_size: int = 1024,
    **overrides,
) -> Path:
    """Train the tokenizer, build the model of ``family`` and save both to ``out_dir``; return it.

    The InternLM2 checkpoint carries no remote code: after ``xtuner_rope.activate()`` it
    resolves to XTuner's InternLM2 classes.

    Args:
        dialogues_jsonl: OpenAI-messages JSONL that trains the tokenizer; None: the samples.
        seed, vocab_size, overrides: As :func:`build_tiny`.

    Raises:
        ValueError: ``family`` is not one of :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise ValueError(f"save_tiny: family {family!r} is not one of {', '.join(FAMILIES)}.")
    out_dir = Path(out_dir)
    tokenizer = train_tokenizer(iter_dialogue_texts(dialogues_jsonl), vocab_size=vocab_size)
    model = build_tiny(family, len(tokenizer), seed=seed, **overrides)
    # Without these, save_pretrained copies XTuner's modeling files and writes `auto_map`, and
    # `trust_remote_code=True` would then load a second, dynamic copy of the classes.
    model._auto_class = None
    model.config._auto_class = None
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def add_internlm2_remote_code(folder: str | Path) -> Path:
    """Give an InternLM2 checkpoint ``folder`` XTuner's modeling code and its ``auto_map``; return it.

    Raises:
        ValueError: ``folder`` has no readable ``config.json``.
    """
    import shutil

    import xtuner._lite.modelings.internlm2 as code

    from xtuner_rope.models.checkpoint_config import read_checkpoint_config

    folder = Path(folder)
    found = read_checkpoint_config(str(folder))
    if found.problem:
        raise ValueError(f"add_internlm2_remote_code: {folder}: {found.problem}")
    for name in ("configuration_internlm2.py", "modeling_internlm2.py"):
        shutil.copy(Path(code.__file__).parent / name, folder / name)
    config = dict(found.data)
    config["auto_map"] = {
        "AutoConfig": "configuration_internlm2.InternLM2Config",
        "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder
