"""What a collated batch must satisfy for XTuner's sequence-parallel shard split (``s % sp ==
0``)."""

from __future__ import annotations

__all__ = ["check_sequence_parallel_rows", "sequence_parallel_padding"]


def sequence_parallel_padding(length: int, sp: int) -> int:
    """Tokens a row of ``length`` needs to reach a multiple of ``sp`` (0 when it divides)."""
    return (-length) % sp


def check_sequence_parallel_rows(shape: tuple[int, int], sp: int, *, pads_itself: bool) -> None:
    """Refuse a ``(b, s)`` batch the sequence-parallel split cannot cut into ``sp`` shards (any
    ``s`` works when xtuner-rope's loss ``pads_itself``).

    Raises:
        ValueError: ``s`` is not a multiple of ``sp`` and XTuner's split would assert.
    """
    b, s = shape
    pad = sequence_parallel_padding(s, sp)
    if sp <= 1 or pads_itself or not pad:
        return
    short = f" (shorter than the {sp} shards)" if s < sp else ""
    raise ValueError(
        f"sequence_parallel_size = {sp}: batch rows 0..{b - 1} are {s} tokens long{short}, not "
        f"a multiple of {sp} ({s} % {sp} = {s % sp}); XTuner's split_for_sequence_parallel "
        "asserts divisibility, and this model's attention is not patched by xtuner-rope (whose "
        f"loss would add a {pad}-token padding segment itself). Collate with "
        f"rope_collate_fn(..., pad_to_multiple_of={sp}) (from xtuner_rope.data.collate import "
        "rope_collate_fn), or enable xtuner-rope (model_resource=dict(fn=enable_xtuner_rope))."
    )
