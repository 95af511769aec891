"""What XTuner's preference ``tokenize`` cuts at ``max_length``, counted: pairs.

:func:`counted_preference_dataset` tokenizes uncut, counts what the cut loses, then applies the
very same cut; ``is_reference`` pairs are counted after XTuner builds them.
"""

from __future__ import annotations

import inspect
import logging
import sys

import numpy as np

from .cut_counts import kept_counts, length_quantile
from .reference_truncation import (
    pairs_head,
    reference_figures,
    reference_warning,
    sequences_note,
    tokenize_ref_counts,
)
from .truncation import FIRST_INDICES, IGNORE_INDEX, record_figures, tokenized_line

RESPONSES = ("chosen", "rejected")
STEP = "XTuner's preference tokenize"


def cut_pair(pair: dict, max_length: int, is_reward: bool) -> dict:
    """``tokenize``'s cut of one pair: each response's first ``max_length`` tokens (a reward token
    kept)."""
    out = {}
    for part in RESPONSES:
        ids, labels = pair[f"{part}_ids"], pair[f"{part}_labels"]
        if is_reward:
            ids, labels = ids[:-1][:max_length] + ids[-1:], labels[:-1][:max_length] + labels[-1:]
        else:
            ids, labels = ids[:max_length], labels[:max_length]
        out[f"{part}_ids"], out[f"{part}_labels"] = ids, labels
    return out


def _supervised(labels: list) -> int:
    return sum(x != IGNORE_INDEX for x in labels)


def pair_figures(pairs: list[dict], max_length: int, is_reward: bool) -> dict:
    """What cutting each response of uncut ``pairs`` at ``max_length`` loses, JSON-ready:
    ``truncation_figures``' keys in pairs, ``unit``, ``step``, ``builder``, ``responses`` (cut)
    and ``unsupervised`` (pairs left with an unsupervised response)."""
    extra = 1 if is_reward else 0  # the reward token, appended after the cut
    longest = np.zeros(len(pairs), dtype=np.int64)
    tokens = [0, 0]
    labels = [0, 0]
    responses = unsupervised = 0
    truncated = []
    for i, pair in enumerate(pairs):
        cut = cut_pair(pair, max_length, is_reward)
        lengths = [len(pair[f"{p}_ids"]) - extra for p in RESPONSES]
        longest[i] = max(lengths)
        responses += sum(n > max_length for n in lengths)
        if longest[i] > max_length:
            truncated.append(i)
        for k, source in enumerate((pair, cut)):
            tokens[k] += sum(len(source[f"{p}_ids"]) for p in RESPONSES)
            labels[k] += sum(_supervised(source[f"{p}_labels"]) for p in RESPONSES)
        unsupervised += not is_reward and any(
            _supervised(pair[f"{p}_labels"]) and not _supervised(cut[f"{p}_labels"])
            for p in RESPONSES
        )
    n = len(pairs)
    return {
        **pairs_head(STEP, max_length, n, len(truncated)),
        "responses": int(responses),
        "unsupervised": int(unsupervised),
        "tokens": kept_counts(*tokens),
        "labels": kept_counts(*labels),
        "keep_all": int(longest.max()) if n else None,
        "keep_99": length_quantile(longest, 0.99),
        "first_truncated": truncated[:FIRST_INDICES],
    }


def _report(figures: dict) -> None:
    """Give ``figures`` to the open counting blocks, else log the start-up line."""
    if record_figures(figures):
        return
    from mmengine.logging import print_log

    warning = reference_warning(figures)
    line = tokenized_line(figures)
    if figures.get("reference"):  # the final lengths, or the warning that names them
        line += f" {warning or sequences_note(figures) + '.'}"
    level = logging.WARNING if figures["truncated"] or warning else logging.INFO
    print_log(line, logger="current", level=level)


def counted_preference_dataset(xtuner_class: type) -> type:
    """A subclass of XTuner's ``PreferenceDataset`` (same arguments) that counts its cut at
    ``max_length`` in ``truncation`` (None where ``max_length`` is not an int)."""
    signature = inspect.signature(xtuner_class.__init__)

    class CountedPreferenceDataset(xtuner_class):
        __doc__ = xtuner_class.__doc__

        def __init__(self, dataset, tokenizer, max_length, *args, **kwargs):
            bound = signature.bind(self, dataset, tokenizer, max_length, *args, **kwargs)
            bound.apply_defaults()
            self.truncation = None
            if bound.arguments["is_reference"] or not isinstance(max_length, int):
                # tokenize_ref re-encodes the cut text: XTuner's pairs as built, counted after
                super().__init__(dataset, tokenizer, max_length, *args, **kwargs)
                if bound.arguments["is_reference"] and isinstance(max_length, int):
                    response = bound.arguments["max_response_length"]
                    counts = tokenize_ref_counts(dataset, tokenizer, max_length, response)
                    self.truncation = reference_figures(
                        counts, max_length, response, self.tokenized_pairs
                    )
                    _report(self.truncation)
                return
            super().__init__(dataset, tokenizer, sys.maxsize, *args, **kwargs)  # uncut
            self.max_length = max_length
            reward = bool(bound.arguments["is_reward"])
            self.truncation = pair_figures(self.tokenized_pairs, max_length, reward)
            self.tokenized_pairs = [cut_pair(p, max_length, reward) for p in self.tokenized_pairs]
            _report(self.truncation)

    CountedPreferenceDataset.xtuner_class = xtuner_class
    CountedPreferenceDataset.__qualname__ = CountedPreferenceDataset.__name__ = "PreferenceDataset"
    CountedPreferenceDataset.__module__ = xtuner_class.__module__
    return CountedPreferenceDataset
