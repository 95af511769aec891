"""Start-up check of sequence parallel against the LLM's head counts, before any weight loads.

With ``sequence_parallel_size = sp``, XTuner's all-to-all gives each rank ``n_h / sp`` heads.
When ``sp`` does not divide ``n_h`` XTuner falls back to its "inner sequence parallel" (a
head-dim split), which gathers with ``gather_for_sequence_parallel``; xtuner 0.2.0 asserts a
non-CPU tensor there, so on a CPU-only machine such a run dies at the first attention, after the
weights are loaded (``models.sequence_parallel.sequence_parallel_attention`` refuses it there
too). The LLM's local ``config.json`` gives the head counts: the start-up (and so
``xtuner-rope doctor``) refuses it first, with the edit.
"""

from __future__ import annotations

from mmengine.config import Config

from xtuner_rope.compat import cpu_only

from .checkpoint_findings import llm_checkpoint_config
from .startup import Finding, register_findings

__all__ = ["checkpoint_heads", "sequence_parallel_heads_findings"]


def checkpoint_heads(cfg: Config) -> tuple[str, int | None]:
    """``(config.json source, num_attention_heads)`` of the LLM's checkpoint (None: unknown,
    e.g. a ``config.json`` that cannot be read, refused by ``config.checkpoint_findings``)."""
    config = llm_checkpoint_config(cfg)
    if config is None or config.data is None:
        return "", None
    heads = config.get("num_attention_heads")
    return config.source, heads if isinstance(heads, int) else None


@register_findings(order=60)
def sequence_parallel_heads_findings(cfg: Config) -> list[Finding]:
    """Refuse ``sequence_parallel_size`` not dividing the attention heads on a CPU-only machine."""
    sp = cfg._cfg_dict.get("sequence_parallel_size", 1)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp <= 1 or not cpu_only():
        return []  # a bad size is refused by startup._sequence_parallel_findings
    where, heads = checkpoint_heads(cfg)
    if heads is None or heads % sp == 0:
        return []
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    return [
        Finding(
            "sequence_parallel_size",
            f"{sp} does not divide the {heads} attention heads (from "
            f"{where}): XTuner's inner sequence parallel, its fallback for that, gathers through "
            "gather_for_sequence_parallel, which refuses CPU tensors (xtuner 0.2.0) after the "
            "weights are loaded",
            f"set sequence_parallel_size to a divisor of {heads} ({', '.join(map(str, divisors))}), "
            "or train on GPUs",
        )
    ]
