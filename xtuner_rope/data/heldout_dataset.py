"""Held-out packing: XTuner's packed rows, never a dialogue cut at a row edge.

XTuner's Packer cuts the token stream every ``max_length`` tokens: a dialogue across a row edge
becomes two documents, the second scored without its first part. A held-out loss must be each
dialogue's loss whole and alone. :func:`heldout_process_hf_dataset` takes
``process_hf_dataset``'s arguments and packs each dialogue whole (``packed_dataset.pack_dataset``
with ``whole=True``, best-fit decreasing), whatever the training's ``offline_packing`` says;
the rows carry ``cumulative_len`` and ``position_ids`` as XTuner's do. The start-up puts it in
place of ``process_hf_dataset`` in a packing ``val_dataloader``.
"""

from __future__ import annotations

import functools

from .packed_dataset import pack_dataset


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

    from xtuner_rope.compat.xtuner_packing import xtuner_pack_step

    with xtuner_pack_step(functools.partial(pack_dataset, whole=True)):
        return process_hf_dataset(dataset, **kwargs)


__all__ = ["heldout_process_hf_dataset"]
