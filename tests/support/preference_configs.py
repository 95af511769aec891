"""XTuner's stock preference configs (DPO, ORPO, reward model) as a user runs them locally.

``write_preference_pairs`` writes local pairs in the format of the stock configs' dataset map
function (``orpo_dpo_mix_40k_map_fn``: ``chosen``/``rejected`` message lists sharing their
prompt, the last message the answer); ``localize_preference`` makes the user's own-machine
edits of a ``xtuner copy-cfg`` copy (checkpoint, data files, short lengths, fp32
``OptimWrapper`` on CPU, a short schedule); ``stock_configs.enable_plugin`` is the one edit.
Every edit must match exactly once, so a change of XTuner's stock files fails loudly.
"""

from __future__ import annotations

import json
from pathlib import Path

import stock_configs as sc

from tools.zoo.localize import short_chat_samples

DPO = "internlm2_chat_1_8b_dpo_full_varlenattn"
DPO_UNPACKED = "internlm2_chat_1_8b_dpo_full"  # use_varlen_attn = False: a response a row
ORPO = "internlm2_chat_1_8b_orpo_full_varlenattn"
REWARD = "internlm2_chat_1_8b_reward_full_varlenattn_ultrafeedback"
DPO_QLORA = "internlm2_chat_7b_dpo_qlora_varlenattn"
LLAMA_DPO_QLORA = "llama3_8b_instruct_dpo_qlora_varlenattn"
STOCK_DATASETS = {
    DPO: "mlabonne/orpo-dpo-mix-40k",
    DPO_UNPACKED: "mlabonne/orpo-dpo-mix-40k",
    ORPO: "mlabonne/orpo-dpo-mix-40k",
    DPO_QLORA: "mlabonne/orpo-dpo-mix-40k",
    LLAMA_DPO_QLORA: "mlabonne/orpo-dpo-mix-40k",
    REWARD: "argilla/ultrafeedback-binarized-preferences-cleaned",
}


def write_preference_pairs(dst: Path, n: int = 240) -> Path:
    """``n`` pairs from the sample dialogues: the real first reply chosen, another rejected.

    The rejected answer is the first reply of the next dialogue with another first reply (a
    fluent but wrong answer), so chosen and rejected differ in content and length, as real
    preference data does.
    """
    turns = list(sc._turns(n + 32))
    rows = []
    for i, (system, users, replies) in enumerate(turns[:n]):
        # the next dialogue whose first reply differs: chosen = rejected trains nothing, and
        # xtuner-rope refuses such pairs before the first step (data/preference_checks.py)
        other = next(t[2] for t in turns[i + 1 :] if t[2][0] != replies[0])
        prompt = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": users[0]}
        ]
        rows.append(
            {
                "chosen": prompt + [{"role": "assistant", "content": replies[0]}],
                "rejected": prompt + [{"role": "assistant", "content": other[0]}],
            }
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return dst


POLAR = "POLAR_1_8B_full_varlenattn_custom_dataset"  # is_reference pairs (tokenize_ref)
STOCK_DATASETS[POLAR] = "/your/custom/path/here"


def write_reference_pairs(dst: Path, n: int = 80, seed: int = 0) -> Path:
    """``n`` pairs in the stock POLAR configs' format (``prompt``, ``reference``, ``chosen``,
    ``rejected`` message lists, no map function) from the sample dialogues: prompts of 1 to 3
    dialogues' system and user turns, each response 1 to 4 replies (~5 to ~200 tokens of the
    tiny tokenizer), the reference and chosen from one dialogue, rejected from the next."""
    import numpy as np

    turns = list(sc._turns(n + 8))
    rng = np.random.default_rng(seed)

    def replies(i: int) -> str:
        return " ".join(r for t in turns[i : i + int(rng.integers(1, 5))] for r in t[2][:1])

    rows = []
    for i in range(n):
        users = [u for t in turns[i : i + int(rng.integers(1, 4))] for u in [t[0], *t[1][:1]] if u]
        rows.append(
            {
                "prompt": [{"role": "user", "content": u} for u in users],
                "reference": [{"role": "assistant", "content": replies(i)}],
                "chosen": [{"role": "assistant", "content": replies(i)}],
                "rejected": [{"role": "assistant", "content": replies(i + 1)}],
            }
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return dst


def localize_preference(
    config: Path,
    name: str,
    data: Path,
    model: Path = sc.TINY_MODEL,
    max_length: int = 256,
    reward_token_id: int | None = None,
    max_response_length: int | None = None,
) -> str:
    """The user's own-machine edits of a stock preference config; returns the new text.

    Args:
        config: The ``xtuner copy-cfg`` copy.
        name: Its stock name (one of ``STOCK_DATASETS``).
        data: A JSON-lines file of pairs (``write_preference_pairs``).
        model: The local checkpoint.
        max_length: Per response; ``max_packed_length`` stays the stock ``max_length * 2``.
        reward_token_id: For reward configs: the id to use (None keeps the stock 92527).
        max_response_length: For the POLAR configs: per response (None keeps the stock 4096).
    """
    text = config.read_text(encoding="utf-8")
    text = sc.sub_once(
        text,
        r'^pretrained_model_name_or_path = ".*"$',
        f'pretrained_model_name_or_path = "{model}"',
    )
    text = sc.sub_once(text, rf'path="{STOCK_DATASETS[name]}"', f'path="json", data_files="{data}"')
    text = sc.sub_once(text, r"^max_length = \d+$", f"max_length = {max_length}")
    text = sc.sub_once(text, r"^lr = .*$", "lr = 1e-3")
    text = sc.sub_once(text, r"^accumulative_counts = \d+", "accumulative_counts = 1")
    text = sc.sub_once(text, r"^    num_proc=32,$", "    num_proc=1,")
    if name in (
        DPO_QLORA,
        LLAMA_DPO_QLORA,
    ):  # LoRA without 4-bit (bitsandbytes' kernels need CUDA); the stock lora_dropout=0.1
        text = sc.sub_once(
            text,
            r"^        torch_dtype=torch.float16,\n        quantization_config="
            r"dict\((\n.*?)*?\n        \),\n",
            "",
        )
    if max_response_length is not None:
        text = sc.sub_once(
            text, r"^max_response_length = \d+", f"max_response_length = {max_response_length}"
        )
    if reward_token_id is not None:
        text = sc.sub_once(text, r"^reward_token_id = \d+", f"reward_token_id = {reward_token_id}")
    if "evaluation_inputs = [" in text:
        text = sc.sub_once(
            text,
            r"^evaluation_inputs = \[\n(.*\n)*?\]$",
            'evaluation_inputs = ["What is 7 plus 5?"]',
        )
    text = short_chat_samples(text)
    text = sc.sub_once(text, r"^    type=AmpOptimWrapper,$", "    type=OptimWrapper,")
    text = sc.sub_once(text, r'^    loss_scale="dynamic",\n    dtype="float16",\n', "")
    return sc.sub_once(
        text,
        r"^from mmengine.optim import AmpOptimWrapper,",
        "from mmengine.optim import OptimWrapper,",
    )


CAPTURE = (
    "\nfrom xtuner_rope.capture.preference import PreferenceCaptureHook  # noqa: E402\n"
    "custom_hooks += [dict(type=PreferenceCaptureHook)]\n"
)


def with_preference_capture(text: str) -> str:
    """Add ``PreferenceCaptureHook`` (iteration 3 saved) at the end of the config."""
    return text + CAPTURE


def tiny_llm_cfg():
    """XTuner's ``llm=dict(...)`` of the tiny InternLM2 (fp32, eager), for building XTuner's
    DPO, ORPO and RewardModel in a test."""
    import torch
    from mmengine.config import ConfigDict
    from transformers import AutoModelForCausalLM

    sc.ensure_tiny_model()
    return ConfigDict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=str(sc.TINY_MODEL),
        trust_remote_code=True,
        torch_dtype=torch.float32,
        attn_implementation="eager",
    )
