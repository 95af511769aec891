"""The boundary channel: where a batch's document boundaries travel to the attention.

XTuner's varlen convention: the ``MessageHub`` instance ``varlen_attn_args``, keys
``cumulative_len_rank_{rank}`` (flat ``[n_docs + 1]`` boundaries) and ``max_seqlen_rank_{rank}``.
Everything that publishes, reads or clears them calls this module.
"""

from __future__ import annotations

from mmengine import MessageHub
from mmengine.dist import get_rank

# MessageHub instance and keys of XTuner's varlen convention.
VARLEN_HUB = "varlen_attn_args"
CUMULATIVE_KEY = "cumulative_len_rank_{rank}"
MAX_SEQLEN_KEY = "max_seqlen_rank_{rank}"
# Sequence parallel only: each token's document length in the full row, for this rank's shard
# (length-dependent RoPE, ``models.rope_documents``; the shard alone cannot see document ends).
LENGTHS_KEY = "document_lengths_rank_{rank}"


def _keys(rank: int | None) -> tuple[str, str]:
    rank = get_rank() if rank is None else rank
    return CUMULATIVE_KEY.format(rank=rank), MAX_SEQLEN_KEY.format(rank=rank)


def publish(cumulative: object, max_seqlen: object, rank: int | None = None) -> None:
    """Publish a batch's boundaries for the attention of ``rank`` (default: this process's).

    Args:
        cumulative: ``[n_docs + 1]`` flat boundaries (int tensor), or None for "none".
        max_seqlen: The longest document (int), or None.
    """
    hub = MessageHub.get_instance(VARLEN_HUB)
    cumulative_key, max_seqlen_key = _keys(rank)
    hub.update_info(cumulative_key, cumulative)
    hub.update_info(max_seqlen_key, max_seqlen)


def read(rank: int | None = None) -> tuple[object, object]:
    """``(cumulative, max_seqlen)`` published for ``rank``; ``(None, None)`` if nothing was."""
    if not MessageHub.check_instance_created(VARLEN_HUB):
        return None, None
    hub = MessageHub.get_instance(VARLEN_HUB)
    cumulative_key, max_seqlen_key = _keys(rank)
    return hub.get_info(cumulative_key), hub.get_info(max_seqlen_key)


def publish_lengths(lengths: object, rank: int | None = None) -> None:
    """Publish the ``[b, S/sp]`` document length of each token of this rank's shard (or None)."""
    rank = get_rank() if rank is None else rank
    MessageHub.get_instance(VARLEN_HUB).update_info(LENGTHS_KEY.format(rank=rank), lengths)


def read_lengths(rank: int | None = None) -> object:
    """The shard's document lengths published by :func:`publish_lengths`, or None."""
    if not MessageHub.check_instance_created(VARLEN_HUB):
        return None
    rank = get_rank() if rank is None else rank
    return MessageHub.get_instance(VARLEN_HUB).get_info(LENGTHS_KEY.format(rank=rank))


def clear(rank: int | None = None) -> None:
    """Forget the published boundaries (a hook's ``after_train_iter``; the next batch is new)."""
    publish(None, None, rank)
    publish_lengths(None, rank)
