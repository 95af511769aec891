"""The local files a row trains on: dialogues in every stock format, pairs, images, tiny models."""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_universal_data(root: Path, n: int = 240) -> Path:
    """One JSON file whose rows carry every column the stock map functions read (every one of
    ``xtuner.dataset.map_fns`` but ModelScope's ``msagent_react``).

    Returns:
        The directory holding ``train.json`` (``load_dataset(path=dir)`` and
        ``load_dataset("json", data_files=[dir/train.json])`` both read it).
    """
    from tools.sample_data import generate_dialogues
    from tools.zoo.formats import code_columns, colour_columns

    rows = []
    own = random.Random(0)  # the columns of the colour and code sets (zoo.formats)
    for dialogue in generate_dialogues(n, seed=0):
        msgs = dialogue["messages"]
        system = next((m["content"] for m in msgs if m["role"] == "system"), "")
        users = [m["content"] for m in msgs if m["role"] == "user"]
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        turns = [{"input": u, "output": r} for u, r in zip(users, replies)]
        turns[0]["system"] = system
        rows.append(
            {
                "instruction": users[0],
                "input": "",
                "output": replies[0],
                "instruction_zh": users[0],
                "input_zh": "",
                "output_zh": replies[0],
                "text": f"### Human: {users[0]}### Assistant: {replies[0]}",
                "messages": msgs,
                "conversation": turns,
                # arxiv, colors, sql, law_reference/crime_kg, openorca, tiny_codes,
                # stack_exchange, wizardlm (ShareGPT) map functions
                "abstract": users[0],
                "title": replies[0],
                "context": system,
                "question": users[0],
                "answer": replies[0],
                "system_prompt": system,
                **colour_columns(own),  # description, color
                # prompt, response, completion: a coding task (tiny codes, Code Alpaca; the
                # answer of openorca and stack_exchange too)
                **code_columns(own),
                "conversations": [
                    {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                    for m in msgs
                    if m["role"] in ("user", "assistant")
                ],
            }
        )
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.json").write_text(json.dumps(rows), encoding="utf-8")
    return root


def write_preference_data(root: Path, n: int = 240) -> Path:
    """Preference pairs in the stock map function's format (``orpo_dpo_mix_40k_map_fn``:
    ``chosen``/``rejected`` message lists sharing their prompt), as JSON lines.

    Returns:
        The ``.jsonl`` file (``load_dataset("json", data_files=...)`` reads it).
    """
    from tools.sample_data import generate_dialogues
    from tools.sample_data.preference_pairs import preference_pairs, write_pairs

    root.mkdir(parents=True, exist_ok=True)
    path = root / "preference_pairs.jsonl"
    write_pairs(preference_pairs(generate_dialogues(n + 1, seed=0), n), str(path))
    return path


def write_llava_images(root: Path) -> Path:
    """12 drawn-image and 12 text dialogues in LLaVA's format; returns the JSON (its images
    under ``images/`` next to it)."""
    from xtuner_rope.demo.llava_data import write_llava_data

    return write_llava_data(root, n_images=12, n_text=12)


def tiny_checkpoint(family: str | None, models: Path) -> Path | None:
    """The family's tiny checkpoint under ``models`` (built once), or None without a builder."""
    from xtuner_rope.demo.tiny import FAMILIES, save_tiny

    if family not in FAMILIES:
        return None
    out = models / f"tiny-{family}"
    if not (out / "config.json").is_file():
        save_tiny(out, family)
    return out
