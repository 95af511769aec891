"""Data in the formats of the stock datasets whose columns are their own: colours, tiny codes, MOSS.

The universal file (:func:`tools.zoo.data.write_universal_data`) gives every map function
its columns, but two of them read what no chat dialogue holds: ``colors_map_fn`` a colour's
``description`` ("Name: what it looks like") and its hex ``color`` (``burkelibbey/colors``), and
``tiny_codes_map_fn`` a programming task ``prompt`` with its ``response`` (prose and code,
``nampdn-ai/tiny-codes``). :func:`colour_columns` and :func:`code_columns` write those columns
as the hub sets hold them, short enough that several fit one 512-token pack.
``MOSSSFTDataset`` reads no columns at all but MOSS's own JSON lines (``meta_instruction``,
``num_turns``, ``chat`` of tagged turns): :func:`write_moss_data` writes both stock files, the
plain dialogues and the tool-use ones (``Commands`` and ``Tool Responses``).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

# Base colours (RGB) and how a modifier moves them: the name and the hex code agree.
BASE_COLOURS = {
    "blue": (40, 90, 200),
    "red": (200, 40, 45),
    "green": (50, 150, 70),
    "yellow": (235, 205, 50),
    "purple": (120, 60, 160),
    "orange": (235, 130, 40),
    "teal": (30, 130, 130),
    "pink": (230, 120, 170),
    "brown": (120, 80, 45),
    "grey": (128, 128, 128),
}
MODIFIERS = {  # name -> (mix towards white (+) or black (-), how it reads)
    "Pale": (0.6, "a soft, washed-out"),
    "Light": (0.35, "a gentle, airy"),
    "Bright": (0.1, "a vivid, lively"),
    "Muted": (-0.15, "a calm, slightly greyed"),
    "Deep": (-0.35, "a rich, saturated"),
    "Dark": (-0.55, "a heavy, shadowy"),
}
EVOKES = (
    "reminds one of a clear summer sky",
    "brings to mind fresh paint on a wooden door",
    "feels like late autumn leaves",
    "suits a quiet reading room",
    "recalls the sea on an overcast morning",
    "works well as an accent on a plain wall",
)


def _hex(rgb: tuple[int, int, int], mix: float) -> str:
    target = 255 if mix > 0 else 0
    return "#" + "".join(f"{round(c + (target - c) * abs(mix)):02x}" for c in rgb)


def colour_columns(rng: random.Random) -> dict[str, str]:
    """One row of ``burkelibbey/colors``: ``description`` ("Name: ...") and its hex ``color``."""
    base = rng.choice(sorted(BASE_COLOURS))
    modifier = rng.choice(sorted(MODIFIERS))
    mix, tone = MODIFIERS[modifier]
    name = f"{modifier} {base}"
    description = f"{name.title()}: {tone} {base} that {rng.choice(EVOKES)}."
    return {"description": description, "color": _hex(BASE_COLOURS[base], mix)}


# Small programming tasks: (task text, function name, parameters, body lines, explanation).
CODE_TASKS = (
    (
        "returns the sum of the even numbers in a list",
        "sum_even",
        "numbers",
        ["return sum(n for n in numbers if n % 2 == 0)"],
        "A generator keeps only even numbers.",
    ),
    (
        "counts the vowels in a string",
        "count_vowels",
        "text",
        ["return sum(1 for ch in text.lower() if ch in 'aeiou')"],
        "Lower-casing first counts capital vowels too.",
    ),
    (
        "checks whether a word is a palindrome",
        "is_palindrome",
        "word",
        ["cleaned = word.lower()", "return cleaned == cleaned[::-1]"],
        "A reversed slice compares the word with itself backwards.",
    ),
    (
        "returns the factorial of n",
        "factorial",
        "n",
        ["result = 1", "for k in range(2, n + 1):", "    result *= k", "return result"],
        "A loop avoids recursion limits for large n.",
    ),
    (
        "reverses the order of the words in a sentence",
        "reverse_words",
        "sentence",
        ["return ' '.join(reversed(sentence.split()))"],
        "split() also drops repeated spaces.",
    ),
    (
        "returns the largest value in a dictionary",
        "max_value",
        "table",
        ["if not table:", "    raise ValueError('empty dictionary')", "return max(table.values())"],
        "An empty dictionary raises a clear error instead of a bare one.",
    ),
    (
        "removes duplicates from a list while keeping the order",
        "unique",
        "items",
        [
            "seen = set()",
            "out = []",
            "for item in items:",
            "    if item not in seen:",
            "        seen.add(item)",
            "        out.append(item)",
            "return out",
        ],
        "A set makes each membership test constant time.",
    ),
    (
        "converts a temperature from Celsius to Fahrenheit",
        "to_fahrenheit",
        "celsius",
        ["return celsius * 9 / 5 + 32"],
        "The formula scales by 9/5 and shifts by 32.",
    ),
)
LANGUAGE_INTROS = (
    "Here is a possible implementation in Python:",
    "Below is a short Python solution:",
    "This Python function does it:",
)


def code_columns(rng: random.Random) -> dict[str, str]:
    """One row of ``nampdn-ai/tiny-codes``: a task ``prompt`` and its ``response`` (prose and a
    Python block); ``completion`` (Code Alpaca's answer column) is the same answer."""
    task, name, params, body, why = rng.choice(CODE_TASKS)
    prompt = f"Write a Python function called {name} that {task}."
    code = "\n".join([f"def {name}({params}):", *(f"    {line}" for line in body)])
    response = f"{rng.choice(LANGUAGE_INTROS)}\n\n```python\n{code}\n```\n\n{why}"
    return {"prompt": prompt, "response": response, "completion": response}


MOSS_META = (
    "You are an AI assistant whose name is MOSS.\n"
    "- MOSS is a conversational language model that is developed by Fudan University. It is "
    "designed to be helpful, honest, and harmless.\n"
    "- MOSS can understand and communicate fluently in the language chosen by the user.\n"
    "Capabilities and tools that MOSS can possess.\n"
)


def _moss_turn(user: str, reply: str, command: str = "None", result: str = "None") -> dict:
    """One turn with MOSS's tags (``Tool Responses`` unsupervised by ``MOSSSFTDataset``)."""
    return {
        "Human": f"<|Human|>: {user}<eoh>\n",
        "Inner Thoughts": "<|Inner Thoughts|>: None<eot>\n",
        "Commands": f"<|Commands|>: {command}<eoc>\n",
        "Tool Responses": f"<|Results|>: {result}<eor>\n",
        "MOSS": f"<|MOSS|>: {reply}<eom>\n",
    }


def moss_rows(n: int, tools: bool, seed: int = 0) -> list[dict]:
    """``n`` MOSS SFT lines: the sample dialogues' exchanges, or (``tools``) sums asked of a
    calculator, its result in ``Tool Responses``, then the answer (checkable: computed here)."""
    from tools.sample_data import generate_dialogues

    rng = random.Random(seed)
    rows = []
    for i, dialogue in enumerate(generate_dialogues(n, seed=seed + int(tools))):
        msgs = [m for m in dialogue["messages"] if m["role"] != "system"]
        turns = [_moss_turn(u["content"], r["content"]) for u, r in zip(msgs[::2], msgs[1::2])]
        if tools:
            a, b = rng.randint(12, 99), rng.randint(12, 99)
            turns.append(
                _moss_turn(
                    f"What is {a} times {b}?",
                    f"{a} times {b} is {a * b}.",
                    command=f'Calculator("{a}*{b}")',
                    result=f'Calculator("{a}*{b}") => {a * b}',
                )
            )
        chat = {f"turn_{k + 1}": turn for k, turn in enumerate(turns)}
        rows.append(
            {
                "conversation_id": i + 1,
                "meta_instruction": MOSS_META,
                "num_turns": len(turns),
                "chat": chat,
                "category": "tools" if tools else "dialogue",
            }
        )
    return rows


MOSS_FILES = {False: "moss-003-sft-no-tools.jsonl", True: "moss-003-sft-with-tools.jsonl"}


def write_moss_data(root: Path, n: int = 60) -> dict[bool, Path]:
    """Both stock MOSS files under ``root`` as JSON lines; ``{tools: path}``.

    ``MOSSSFTDataset`` caches its tokenized lines next to the file it read, under the file's
    name with ``.jsonl`` replaced: the names must end in ``.jsonl`` (any other name makes the
    cache the source file itself). Caches of an earlier sweep are removed with the files.
    """
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob("moss-003-sft-*"):
        old.unlink()
    paths = {}
    for tools, name in MOSS_FILES.items():
        lines = (json.dumps(row, ensure_ascii=False) for row in moss_rows(n, tools))
        paths[tools] = root / name
        paths[tools].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def localize_moss(text: str, moss: dict[bool, Path] | None) -> str:
    """Point a config's MOSS settings at the local files: ``moss_sft_no_plugins_path`` at the
    plain dialogues, ``moss_sft_plugins_path`` at the tool-use ones (no such setting: as is)."""
    if moss is None:
        return text
    for setting, tools in (("moss_sft_no_plugins_path", False), ("moss_sft_plugins_path", True)):
        text = re.sub(rf"^{setting} = .*$", f'{setting} = "{moss[tools]}"', text, flags=re.M)
    return text
