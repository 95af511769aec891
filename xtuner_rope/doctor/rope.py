"""What the doctor says about length-dependent RoPE (dynamic NTK, LongRoPE): threshold, who crosses
it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mmengine.config import Config

from xtuner_rope.models.rope_documents import PER_DOCUMENT_KEY
from xtuner_rope.models.rope_settings import checkpoint_rope

__all__ = ["rope_figures", "rope_lines", "rope_problems"]


def rope_figures(cfg: Config, lengths: Sequence[int], packed: bool) -> dict | None:
    """The RoPE entry of the report for documents of ``lengths`` tokens (``packed``: several to a
    row); None when the checkpoint's ``config.json`` is unknown."""
    llm = (cfg.get("model") or {}).get("llm") or {}
    where, setting = checkpoint_rope(llm.get("pretrained_model_name_or_path"))
    if setting is None:
        return None
    threshold = setting.threshold
    past = 0 if threshold is None else int(np.count_nonzero(np.asarray(lengths) > threshold))
    return {
        "config_json": where,
        "rope_type": setting.rope_type,
        "length_dependent": setting.length_dependent,
        "threshold": threshold,
        "documents": len(lengths),
        "documents_past_threshold": past,
        "packed": packed,
        "per_document": cfg.get(PER_DOCUMENT_KEY, True) is not False,
    }


def rope_lines(rope: dict | None) -> list[str]:
    """The summary line (none for RoPE whose frequencies do not depend on the length)."""
    if not rope or not rope["length_dependent"]:
        return []
    head = (
        f"rope         {rope['rope_type']}: {rope['documents_past_threshold']} of "
        f"{rope['documents']} documents longer than {rope['threshold']} tokens"
    )
    if not rope["packed"] or not rope["documents_past_threshold"]:
        return [head + " (frequencies as upstream picks them)"]
    if rope["per_document"]:
        return [head + "; in packed rows they get their own frequencies (per document)"]
    return [head + f"; {PER_DOCUMENT_KEY} = False: their rows share one set of frequencies"]


def rope_problems(rope: dict | None) -> list[str]:
    """A problem when packed documents would get another document's frequencies."""
    if not rope or not rope["length_dependent"] or rope["per_document"] or not rope["packed"]:
        return []
    if not rope["documents_past_threshold"]:
        return []
    return [
        f"{PER_DOCUMENT_KEY} = False with {rope['rope_type']} RoPE: "
        f"{rope['documents_past_threshold']} documents are longer than {rope['threshold']} "
        "tokens, and every document packed with one gets the frequencies of its row's longest "
        f"document, not its own (silently different from training it alone)\n  -> remove "
        f"{PER_DOCUMENT_KEY} = False (the default gives each document its own frequencies)"
    ]
