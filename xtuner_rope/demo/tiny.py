"""Tiny checkpoints of every supported family: a tokenizer trained on our sample dialogues
and a seeded model (InternLM2, Llama, Qwen2, Mistral, Phi-3, Mixtral, Qwen2-MoE, Gemma,
Cohere; 2 layers, hidden 64).

Everything here is deterministic and offline: the same dialogues and seed give the same
tokenizer files and the same weights, so tests and demos never download a checkpoint. The
default dialogues are the sample the package ships (``xtuner_rope.demo.sample_dialogues``:
``short_dialogues.jsonl``, linked from ``data/``), so nothing depends on the current directory.
InternLM2 uses the classes XTuner ships (``xtuner._lite.modelings.internlm2``, registered with the
``transformers`` Auto factories by ``xtuner_rope.compat``); the others are transformers' own.
``python tools/make_tiny.py --family mistral --out DIR`` writes one.
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


FAMILIES = (
    "internlm2",
    "llama",
    "qwen2",
    "mistral",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "gemma",
    "cohere",
)

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
    """Yield every message content of an OpenAI-messages JSONL file, in file order.

    Args:
        jsonl_path: The file; None: the sample dialogues the package ships
            (:func:`~xtuner_rope.demo.sample_dialogues.sample_path`), wherever the current
            directory is.
    """
    if jsonl_path is None:
        from .sample_dialogues import sample_path

        jsonl_path = sample_path()
    with open(jsonl_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                for message in json.loads(line)["messages"]:
                    yield message["content"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer with the InternLM2 chat special tokens.

    Byte-level BPE never produces an unknown token, so any text a user types at the tiny
    model round-trips. Training is deterministic for a given text order.

    Args:
        texts: Training texts.
        vocab_size: Target vocabulary size, special tokens included.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with bos/eos/pad/unk set and a ChatML
        chat template.
    """
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


def build_tiny_internlm2(vocab_size: int, seed: int = 0, **overrides):
    """Build a randomly initialised tiny ``InternLM2ForCausalLM`` (XTuner's shipped class).

    Args:
        vocab_size: Embedding rows; use ``len(tokenizer)``.
        seed: Seed for the weight initialisation (the global torch RNG is restored after).
        **overrides: ``InternLM2Config`` fields replacing ``TINY_MODEL_KWARGS`` (e.g.
            ``attn_implementation='sdpa'``, ``rope_scaling={'type': 'linear', 'factor': 2.0}``).

    Returns:
        The model in fp32 and eval mode.
    """
    from xtuner._lite.modelings.internlm2 import InternLM2Config, InternLM2ForCausalLM

    config = InternLM2Config(vocab_size=vocab_size, **{**TINY_MODEL_KWARGS, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = InternLM2ForCausalLM(config)
    return model.eval()


def build_tiny_hf(family: str, vocab_size: int, seed: int = 0, **overrides):
    """Build a randomly initialised tiny transformers ``ForCausalLM`` of ``family``.

    Same sizes as the tiny InternLM2 (``TINY_MODEL_KWARGS``), GQA included, plus the family's
    quirks (``FAMILY_KWARGS``).

    Args:
        family: One of :data:`FAMILIES` but ``'internlm2'``.
        vocab_size: Embedding rows; use ``len(tokenizer)``.
        seed: Seed for the weight initialisation (the global torch RNG is restored after).
        **overrides: Config fields replacing the defaults.

    Returns:
        The model in fp32 and eval mode.
    """
    import transformers

    names = {
        "llama": "Llama",
        "qwen2": "Qwen2",
        "mistral": "Mistral",
        "phi3": "Phi3",
        "mixtral": "Mixtral",
        "qwen2_moe": "Qwen2Moe",
        "gemma": "Gemma",
        "cohere": "Cohere",
    }
    if family not in names:
        raise ValueError(f"build_tiny_hf: family {family!r} is not one of {sorted(names)}.")
    config_cls = getattr(transformers, f"{names[family]}Config")
    model_cls = getattr(transformers, f"{names[family]}ForCausalLM")
    kwargs = {**TINY_MODEL_KWARGS, **FAMILY_KWARGS.get(family, {}), **overrides}
    config = config_cls(vocab_size=vocab_size, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.eval()


def build_tiny(family: str, vocab_size: int, seed: int = 0, **overrides):
    """The tiny model of ``family`` (one of :data:`FAMILIES`)."""
    if family not in FAMILIES:
        raise ValueError(f"build_tiny: family {family!r} is not one of {', '.join(FAMILIES)}.")
    if family == "internlm2":
        return build_tiny_internlm2(vocab_size, seed=seed, **overrides)
    return build_tiny_hf(family, vocab_size, seed=seed, **overrides)


def save_tiny_internlm2(
    out_dir: str | Path,
    dialogues_jsonl: str | Path | None = None,
    seed: int = 0,
    vocab_size: int = 1024,
    family: str = "internlm2",
    **overrides,
) -> Path:
    """Train the tokenizer, build the model and save both as one checkpoint directory.

    The tokenizer files are saved with the weights, so ``AutoTokenizer`` and
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` load it offline. The transformers
    families load with plain transformers. The InternLM2 checkpoint carries no remote code (no
    ``auto_map``): after ``xtuner_rope.activate()`` it resolves to XTuner's InternLM2 classes.

    Args:
        out_dir: Directory to write (created if missing, files overwritten).
        dialogues_jsonl: OpenAI-messages JSONL whose texts train the tokenizer; None: the
            package's sample dialogues.
        seed: Weight-initialisation seed.
        vocab_size: Tokenizer vocabulary size.
        family: One of :data:`FAMILIES` (default ``'internlm2'``).
        **overrides: Config fields of the model (e.g. ``rope_scaling``, ``max_position_embeddings``).

    Returns:
        ``out_dir`` as a ``Path``.
    """
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


def save_tiny(
    out_dir: str | Path,
    family: str = "internlm2",
    dialogues_jsonl: str | Path | None = None,
    seed: int = 0,
    vocab_size: int = 1024,
    **overrides,
) -> Path:
    """The tiny checkpoint of ``family`` written to ``out_dir`` (see :func:`save_tiny_internlm2`).

    Raises:
        ValueError: ``family`` is not one of :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise ValueError(f"save_tiny: family {family!r} is not one of {', '.join(FAMILIES)}.")
    return save_tiny_internlm2(
        out_dir, dialogues_jsonl, seed=seed, vocab_size=vocab_size, family=family, **overrides
    )


def add_internlm2_remote_code(folder: str | Path) -> Path:
    """Give an InternLM2 checkpoint folder its modeling code, as hub checkpoints ship it.

    Copies XTuner's ``configuration_internlm2.py`` and ``modeling_internlm2.py`` (the current
    hub version) into ``folder`` and writes their ``auto_map`` into its ``config.json``, so
    ``trust_remote_code=True`` loads it without xtuner-rope's Auto registration.

    Returns:
        ``folder`` as a ``Path``.
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
