"""Preference pairs for the tiny DPO and reward recipes, built from the sample dialogues.

Each pair takes a dialogue's first exchange: its system message (if any) and first user
message are the shared prompt, its first assistant reply is ``chosen``, and the first reply
of the next dialogue is ``rejected`` (fluent, but an answer to another question; where that
reply is the same text, as stock greetings recur, the first different reply after it). The
format is that of XTuner's ``orpo_dpo_mix_40k_map_fn`` (``chosen``/``rejected`` message lists sharing
their prompt, the last message the answer), which the stock DPO, ORPO and reward configs use.
"""

from __future__ import annotations

import json

__all__ = ["preference_pairs", "write_pairs"]


def _first_exchange(dialogue: dict) -> tuple[list[dict], str]:
    """(prompt messages, first assistant reply) of one ``{"messages": [...]}`` record."""
    messages = dialogue["messages"]
    system = [m for m in messages[:1] if m["role"] == "system"]
    user = next(m for m in messages if m["role"] == "user")
    reply = next(m["content"] for m in messages if m["role"] == "assistant")
    return system + [{"role": "user", "content": user["content"]}], reply


def preference_pairs(dialogues: list[dict], n: int) -> list[dict]:
    """``n`` pairs from the first ``n`` dialogues (deterministic: no randomness).

    Args:
        dialogues: Records in OpenAI chat format (``data/short_dialogues.jsonl``).
        n: Number of pairs.

    Returns:
        ``{"chosen": [...], "rejected": [...]}`` records.

    Raises:
        ValueError: Fewer than ``n + 1`` dialogues, or no different reply after one of the
            first ``n``.
    """
    if len(dialogues) < n + 1:
        raise ValueError(
            f"preference_pairs: {n} pairs need {n + 1} dialogues, got "
            f"{len(dialogues)}; pass fewer pairs or more dialogues"
        )
    exchanges = [_first_exchange(d) for d in dialogues]
    pairs = []
    for i, (prompt, reply) in enumerate(exchanges[:n]):
        other = next((o for _, o in exchanges[i + 1 :] if o != reply), None)
        if other is None:
            raise ValueError(
                f"preference_pairs: no reply after dialogue {i} differs from its "
                f"own ({reply[:40]!r}); pass more dialogues"
            )
        pairs.append(
            {
                "chosen": prompt + [{"role": "assistant", "content": reply}],
                "rejected": prompt + [{"role": "assistant", "content": other}],
            }
        )
    return pairs


def write_pairs(pairs: list[dict], path: str) -> None:
    """Write pairs as UTF-8 JSON Lines (stable bytes: insertion key order, ``\\n`` endings)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
