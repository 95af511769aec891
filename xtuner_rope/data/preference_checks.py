"""XTuner's preference pairs (DPO, ORPO, reward model), checked before the first step.

Chosen equal to rejected, a response without a supervised token, labels not as long as the
ids, and pairs dropped by ``PackedDatasetWrapper`` train silently wrong: named and refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from xtuner_rope.batch.items import IGNORE_INDEX

__all__ = ["check_preference_dataset", "dataset_pairs", "preference_pair_problems"]


def _first(items: list, n: int = 5) -> str:
    return ", ".join(str(i) for i in items[:n]) + (", ..." if len(items) > n else "")


def preference_pair_problems(
    pairs: Sequence[Mapping], dropped: Sequence[tuple[int, int]] = (), max_packed_length=None
) -> list[str]:
    """What in ``[n]`` tokenized preference pairs trains silently wrong, naming pairs and fix;
    ``dropped``: ``(pair index, length)`` of those ``PackedDatasetWrapper`` dropped."""
    equal, unsupervised, mismatch = [], [], []
    for i, pair in enumerate(pairs):
        if list(pair["chosen_ids"]) == list(pair["rejected_ids"]):
            equal.append(i)
        for side in ("chosen", "rejected"):
            ids, labels = pair[f"{side}_ids"], pair[f"{side}_labels"]
            if len(ids) != len(labels):
                mismatch.append(f"{i} ({side}: {len(labels)} labels, {len(ids)} ids)")
            elif all(label == IGNORE_INDEX for label in labels):
                unsupervised.append(f"{i} ({side})")
    problems = []
    if equal:
        problems.append(
            f"train_dataloader.dataset: {len(equal)} pairs whose chosen and rejected are the same "
            f"tokens (first: {_first(equal)}): their two log-probs (rewards) cancel, so they "
            "train nothing yet count as pairs in the loss. Remove them from the data or give "
            "them a real rejected answer."
        )
    if unsupervised:
        problems.append(
            f"train_dataloader.dataset: responses with no supervised token (first: "
            f"{_first(unsupervised, 3)}): the answer was cut away by max_length (or the prompt "
            "fills it), so its log-prob is a sum over nothing. Raise max_length or shorten "
            "the prompts."
        )
    if mismatch:
        problems.append(
            f"train_dataloader.dataset: responses whose labels are not as long as their ids "
            f"(first: {_first(mismatch, 3)}): a source row without an answer turn; packed, "
            "the labels would slide against the ids. Give every chosen and rejected "
            "conversation its assistant answer, or remove the row."
        )
    if dropped:
        longest = max(n for _, n in dropped)
        problems.append(
            f"train_dataloader.dataset.max_packed_length={max_packed_length}: "
            f"{len(dropped)} pairs are longer (chosen + rejected; first: "
            f"{_first([f'{i} ({n} tokens)' for i, n in dropped], 3)}) and PackedDatasetWrapper "
            f"drops them, logging only a count. Set max_packed_length >= {longest} "
            "(2 * max_length + 2 keeps every pair)."
        )
    return problems


def dataset_pairs(dataset) -> tuple[list[Mapping], list[tuple[int, int]], int | None] | None:
    """``(pairs, dropped, max_packed_length)`` of XTuner's preference dataset, else None; the
    ``unpacked_pairs`` a patched ``PackedDatasetWrapper`` keeps name pairs by source index.
    """
    name = type(dataset).__name__
    if name == "PreferenceDataset":
        return list(dataset.tokenized_pairs), [], None
    if name == "PackedDatasetWrapper":
        source = getattr(dataset, "unpacked_pairs", None)
        limit = dataset.max_packed_length
        if source is None:  # the wrapper without the compat patch: its packed pairs
            return [pair for row in dataset.data for pair in row], [], limit
        pairs = [source[i] for i in range(len(source))]
        lengths = [len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs]
        return pairs, [(i, n) for i, n in enumerate(lengths) if n > limit], limit
    return None


def check_preference_dataset(dataset) -> None:
    """Refuse an XTuner preference dataset with any of :func:`preference_pair_problems`.

    Raises:
        ValueError: every problem found, each naming its pairs and the fix.
    """
    found = dataset_pairs(dataset)
    if found is None:
        return
    pairs, dropped, limit = found
    problems = preference_pair_problems(pairs, dropped, limit)
    if problems:
        items = "\n".join(f"{i}. {p}" for i, p in enumerate(problems, 1))
        raise ValueError(
            f"xtuner-rope: the preference pairs would train silently wrong ({len(pairs)} pairs, "
            f"numbered in dataset order); fix the data or the setting and start again:\n{items}"
        )
