"""Held-out packing: XTuner's packed rows, never a dialogue cut at a row edge."""

from __future__ import annotations

import functools

from .packed_dataset import pack_dataset


def heldout_process_hf_dataset(dataset, **kwargs):
    """``xtuner.dataset.process_hf_dataset`` (same arguments), rows of whole dialogues
    (``use_varlen_attn=True`` keeps the boundaries)."""
    from xtuner.dataset.huggingface import process_hf_dataset

    from xtuner_rope.compat.xtuner_packing import xtuner_pack_step

    with xtuner_pack_step(functools.partial(pack_dataset, whole=True)):
        return process_hf_dataset(dataset, **kwargs)


__all__ = ["heldout_process_hf_dataset"]
