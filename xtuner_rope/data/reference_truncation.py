"""What XTuner's ``tokenize_ref`` cuts from ``is_reference`` preference pairs, in text tokens.

It keeps each response's first ``max_response_length`` tokens and the prompt's last
``(max_length - 4 - reference - response) // 2`` (<= 0: nearly whole, ``no_room``), then
re-encodes: the final sequences are not bounded by ``max_length``.
"""

from __future__ import annotations

import numpy as np

from .cut_counts import FIRST_INDICES, kept_counts, length_quantile

RESPONSES = ("reference", "chosen", "rejected")
RESERVED = 4  # tokenize_ref's own: one RM token, two separators, one reward token
STEP = "XTuner's preference tokenize_ref"
ENCODE_CHUNK = 1024  # texts per tokenizer call


def _encoded(texts: list[str], tokenizer):
    """Each text's ids as ``tokenize_ref`` encodes them (``add_special_tokens=True``)."""
    for i in range(0, len(texts), ENCODE_CHUNK):
        yield from tokenizer(texts[i : i + ENCODE_CHUNK], add_special_tokens=True)["input_ids"]


def _texts(dataset, part: str) -> list[str]:
    """``tokenize_ref``'s text of ``part``: the messages' contents joined by newlines."""
    column = dataset[part] if hasattr(dataset, "column_names") else [row[part] for row in dataset]
    return ["\n".join(m["content"] for m in messages) for messages in column]


def tokenize_ref_counts(dataset, tokenizer, max_length: int, max_response_length: int) -> dict:
    """``tokenize_ref``'s cut of each pair of ``dataset``, counted on the same tokenizations.

    Returns:
        ``length`` / ``kept`` (all tokens) and ``text`` / ``text_kept`` (ids outside
        ``all_special_ids``), each ``{part: [n]}``; ``budget`` ``[n]`` (``max_prompt_length``);
        ``lead`` ``[n]`` (leading special tokens).
    """
    special = np.asarray(sorted(set(tokenizer.all_special_ids)), dtype=np.int64)
    length, kept, text, text_kept = {}, {}, {}, {}
    for part in RESPONSES:
        rows = [
            (len(ids), ~np.isin(ids, special)) for ids in _encoded(_texts(dataset, part), tokenizer)
        ]
        length[part] = np.asarray([n for n, _ in rows], dtype=np.int64)
        kept[part] = np.minimum(length[part], max_response_length)
        text[part] = np.asarray([t.sum() for _, t in rows], dtype=np.int64)
        text_kept[part] = np.asarray(
            [t[:max_response_length].sum() for _, t in rows], dtype=np.int64
        )
    room = max_length - RESERVED - kept["reference"]
    budget = np.minimum((room - kept["chosen"]) // 2, (room - kept["rejected"]) // 2)
    prompt_rows = []
    for ids, b in zip(_encoded(_texts(dataset, "prompt"), tokenizer), budget):
        is_text = ~np.isin(ids, special)
        p = len(ids)
        # prompt[-b:] (XTuner's slice): the last b tokens; all of them at 0; from token -b on below
        left = p if p <= b else (b if b > 0 else (p if b == 0 else max(p + b, 0)))
        lead = int(np.argmax(is_text)) if is_text.any() else p
        prompt_rows.append((p, left, int(is_text.sum()), int(is_text[p - left :].sum()), lead))
    columns = np.asarray(prompt_rows, dtype=np.int64).reshape(-1, 5).T
    length["prompt"], kept["prompt"], text["prompt"], text_kept["prompt"], lead = columns
    return {
        "length": length,
        "kept": kept,
        "text": text,
        "text_kept": text_kept,
        "budget": budget,
        "lead": lead,
    }


def pairs_head(step: str, max_length: int, pairs: int, truncated: int) -> dict:
    """The keys every preference-pair report shares with ``data.truncation``'s figures."""
    return {
        "max_length": int(max_length),
        "unit": "pair",
        "step": step,
        "builder": "build_preference_dataset",
        "dialogues": pairs,
        "documents": 0,
        "pretraining": False,
        "truncated": truncated,
        "dropped": 0,
        "split": 0,
    }


def reference_figures(counts: dict, max_length: int, max_response_length: int, built: list) -> dict:
    """What ``tokenize_ref``'s cut of ``counts`` (:func:`tokenize_ref_counts`) loses, JSON-ready.

    ``built``: XTuner's built pairs (``chosen_ids`` / ``rejected_ids``), for the final lengths.

    Returns:
        ``truncation_figures``' keys in pairs (``responses`` that lose text), and ``reference``:
        ``max_response_length``, ``keep_response_length``, ``prompts``, ``prompt_tokens`` /
        ``response_tokens``, ``no_room``, ``fit_all``, ``sequences``, ``over_max_length``, ``longest``.
    """
    length, kept, text, text_kept = (counts[k] for k in ("length", "kept", "text", "text_kept"))
    n = len(counts["budget"])
    response_cut = np.stack([text_kept[p] < text[p] for p in RESPONSES])  # [3, n]
    prompt_cut = text_kept["prompt"] < text["prompt"]
    truncated = np.flatnonzero(response_cut.any(axis=0) | prompt_cut)
    # the prompt's text whole needs max_prompt_length >= its tokens after the leading specials
    prompt_text = length["prompt"] - counts["lead"]
    longer = np.maximum(length["chosen"], length["rejected"])
    whole = RESERVED + length["reference"] + longer + 2 * prompt_text  # [n]
    fit = RESERVED + kept["reference"] + np.maximum(kept["chosen"], kept["rejected"])
    fit = fit + 2 * prompt_text
    final = np.asarray(
        [len(pair[f"{r}_ids"]) for pair in built for r in ("chosen", "rejected")], dtype=np.int64
    )
    responses = np.concatenate([text[p] for p in RESPONSES])
    responses_kept = np.concatenate([text_kept[p] for p in RESPONSES])
    return {
        **pairs_head(STEP, max_length, n, len(truncated)),
        "responses": int(response_cut.sum()),
        "unsupervised": 0,
        "tokens": kept_counts(sum(text.values()).sum(), sum(text_kept.values()).sum()),
        "labels": {"before": 2 * n, "after": 2 * n, "lost": 0},  # one reward label a sequence
        "keep_all": int(whole.max()) if n else None,
        "keep_99": length_quantile(whole, 0.99),
        "first_truncated": [int(i) for i in truncated[:FIRST_INDICES]],
        "reference": {
            "max_response_length": int(max_response_length),
            "keep_response_length": int(max(length[p].max() for p in RESPONSES)) if n else None,
            "prompts": int(prompt_cut.sum()),
            "prompt_tokens": kept_counts(text["prompt"].sum(), text_kept["prompt"].sum()),
            "response_tokens": kept_counts(responses.sum(), responses_kept.sum()),
            "no_room": int(((counts["budget"] <= 0) & (text["prompt"] > 0)).sum()),
            "fit_all": int(fit.max()) if n else None,
            "sequences": len(final),
            "over_max_length": int((final > max_length).sum()),
            "longest": int(final.max()) if len(final) else None,
        },
    }


def reference_message(figures: dict) -> str | None:
    """The sentence on what ``tokenize_ref`` cuts (start-up line, doctor), None for nothing."""
    if not figures["truncated"]:
        return None
    ref = figures["reference"]
    p, r = ref["prompt_tokens"], ref["response_tokens"]
    return (
        f"{figures['step']} cuts {figures['truncated']} of {figures['dialogues']} pairs at "
        f"max_length={figures['max_length']}, max_response_length={ref['max_response_length']}: "
        f"{figures['responses']} responses (reference, chosen, rejected) lose {r['lost']} of "
        f"{r['before']} text tokens at their end, {ref['prompts']} prompts lose {p['lost']} of "
        f"{p['before']} at their start; max_length = {figures['keep_all']} with "
        f"max_response_length = {ref['keep_response_length']} keeps every pair whole, "
        f"{figures['keep_99']} keeps 99% of them"
    )


def sequences_note(figures: dict) -> str:
    """How many final sequences XTuner's re-encoding makes longer than ``max_length``."""
    ref = figures["reference"]
    return (
        f"{ref['over_max_length']} of {ref['sequences']} sequences (reference + response, each "
        f"with the prompt, re-encoded) are longer than max_length={figures['max_length']} "
        f"(longest {ref['longest']})"
    )


def reference_warning(figures: dict | None) -> str | None:
    """The warning for pairs whose responses leave the prompt no room, or None. Its edit:
    ``max_response_length <= (max_length - 6) // 2`` (two responses leave the prompt at least one
    token), or a larger ``max_length``."""
    ref = (figures or {}).get("reference")
    if not ref or not ref["no_room"]:
        return None
    return (
        f"{ref['no_room']} of {figures['dialogues']} pairs leave the prompt no room "
        f"(max_length={figures['max_length']} - 4 - reference - response < 2 tokens after the "
        f"cut at max_response_length={ref['max_response_length']}): {figures['step']} then "
        "keeps the whole prompt (or drops only its first tokens) instead of shortening it, and "
        f"{sequences_note(figures)}\n  -> set max_response_length = "
        f"{max((figures['max_length'] - 6) // 2, 1)} or less (two responses then leave the "
        f"prompt room), or max_length = {ref['fit_all']} (every prompt whole)"
    )
