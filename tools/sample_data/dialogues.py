"""Deterministic sample of short chat dialogues for fine-tuning demos.

Real SFT data is mostly short: one-word replies, bare greetings, empty system prompts and a
minority of multi-turn chats. This module shapes such dialogues (greetings, system prompts,
follow-ups, thanks) around the exchanges of ``topics``, all drawn from one seeded
``random.Random``, so the shipped ``xtuner_rope/demo/short_dialogues.jsonl`` (and
``data/short_dialogues.jsonl``, a link to it) regenerates byte for byte. Checkable
answers are computed there rather than typed in, so a model trained on the file learns true
things.
"""

import json
import random

from . import tables as T
from .topics import topic

# Rough token budget: ~100 English words is ~150 tokens, the upper end of a "short" dialogue.
MAX_WORDS = 100


def _turns(rng):
    """Pick a dialogue shape: mostly one exchange, sometimes 2-4 with greetings and thanks."""
    hello = (rng.choice(T.HELLO_USER), rng.choice(T.HELLO_BOT))
    thanks = (rng.choice(T.THANKS_USER), rng.choice(T.THANKS_BOT))
    shape = rng.random()
    if shape < 0.07:
        return [hello]  # a bare greeting is a whole dialogue surprisingly often
    exchanges = topic(rng)
    if shape < 0.54:
        return exchanges[:1]
    turns = exchanges[: rng.randint(1, len(exchanges))]
    while len(turns) < 3 and rng.random() < 0.6:
        turns += topic(rng)[:1]
    if rng.random() < 0.4:
        turns.insert(0, hello)
    if len(turns) < 2 or rng.random() < 0.4:
        turns.append(thanks)
    return turns[:4]


def _system(rng):
    """System message: absent, present but empty, or a real prompt (all three occur in the wild)."""
    r = rng.random()
    if r < 0.3:
        return []
    content = "" if r < 0.45 else rng.choice(T.SYSTEM_PROMPTS)
    return [{"role": "system", "content": content}]


def dialogue_words(dialogue):
    """Count whitespace-separated words over all messages of one dialogue.

    Args:
        dialogue: A record ``{"messages": [{"role": ..., "content": ...}, ...]}``.

    Returns:
        The total number of words, system prompt included.
    """
    return sum(len(m["content"].split()) for m in dialogue["messages"])


def _dialogue(rng):
    """Build one dialogue, redrawing until it fits the ~150-token budget."""
    while True:
        messages = _system(rng)
        for user, assistant in _turns(rng):
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": assistant})
        dialogue = {"messages": messages}
        if dialogue_words(dialogue) <= MAX_WORDS:
            return dialogue


def generate_dialogues(n=2400, seed=0):
    """Generate ``n`` short chat dialogues, identical for identical ``(n, seed)``.

    Args:
        n: Number of dialogues.
        seed: Seed of the private ``random.Random``; the global RNG is never touched.

    Returns:
        A list of ``{"messages": [...]}`` records in OpenAI chat format: an optional system
        message, then user/assistant turns that alternate and end with the assistant.
    """
    rng = random.Random(seed)
    return [_dialogue(rng) for _ in range(n)]


def to_jsonl(dialogues):
    """Serialise dialogues as JSON Lines, one dialogue per ``\\n``-terminated line.

    Key order is the insertion order (``messages``; ``role`` before ``content``) and
    ``ensure_ascii=False`` keeps text readable, so the bytes are stable across runs.

    Args:
        dialogues: Records as returned by :func:`generate_dialogues`.

    Returns:
        The file contents as one string.
    """
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in dialogues)


def write_jsonl(dialogues, path):
    """Write dialogues to ``path`` as UTF-8 JSON Lines with ``\\n`` line endings.

    Args:
        dialogues: Records as returned by :func:`generate_dialogues`.
        path: Output file path; parent folders must exist.
    """
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(to_jsonl(dialogues))
