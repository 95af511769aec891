"""Held-out packing: XTuner's packed rows, but no dialogue cut at a row edge.

XTuner's Packer (and ``lossless_process_hf_dataset``) cuts the token stream every
``max_length`` tokens: a dialogue across a row edge becomes two documents, the second scored
without its first part. Harmless noise for training, wrong for a held-out loss that must be
each dialogue's loss whole and alone. :func:`heldout_process_hf_dataset` takes
``process_hf_dataset``'s arguments and packs whole dialogues greedily, in dataset order, into
rows of at most ``max_length`` tokens (XTuner already truncated each dialogue to
``max_length``); the rows carry ``cumulative_len`` and ``position_ids`` as XTuner's do. The
start-up puts it in place of ``process_hf_dataset`` in a packing ``val_dataloader``.
"""

from __future__ import annotations

import functools

import numpy as np

from .packed_dataset import pack_dataset


def whole_dialogue_plan(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Row offsets that fill rows with whole dialogues, in order, up to ``max_length`` each.

    Args:
        lengths: ``[n]`` token counts of the dialogues, in dataset order.
        max_length: Tokens per packed row; a longer dialogue gets a row of its own.

    Returns:
        ``[r + 1]`` int64 row offsets into the concatenated stream (0 first, the total last),
        each at a dialogue end.

    Raises:
        ValueError: ``max_length`` is not a positive integer.
    """
    if not isinstance(max_length, (int, np.integer)) or max_length <= 0:
        raise ValueError(
            f"heldout_process_hf_dataset: max_length must be a positive integer, got "
            f"{max_length!r}; set max_length in PART 1 of the config."
        )
    cuts, start, end = [0], 0, 0
    for length in np.asarray(lengths, dtype=np.int64).tolist():
        if end > start and end + length - start > max_length:
            cuts.append(end)
            start = end
        end += length
    if end > start:
        cuts.append(end)
    return np.asarray(cuts, dtype=np.int64)


def heldout_process_hf_dataset(dataset, **kwargs):
    """``xtuner.dataset.process_hf_dataset`` (same arguments), packing whole dialogues.

    Args:
        dataset: As ``process_hf_dataset``.
        **kwargs: As ``process_hf_dataset``; with ``pack_to_max_length=True`` the rows hold
            whole dialogues (set ``use_varlen_attn=True`` to keep their boundaries, as the
            start-up does).

    Returns:
        The held-out dataset, rows of whole dialogues.
    """
    from xtuner.dataset.huggingface import process_hf_dataset

    from xtuner_rope.compat import xtuner_pack_step

    with xtuner_pack_step(functools.partial(pack_dataset, plan=whole_dialogue_plan)):
        return process_hf_dataset(dataset, **kwargs)


__all__ = ["heldout_process_hf_dataset", "whole_dialogue_plan"]
