"""The kinds of ``xtuner-rope check`` and the dispatch over them, as ``models.families`` has
``FAMILIES``.

Each kind module has ``KIND``, ``applies(cfg)``, ``run(cfg, request)`` (the JSON-ready report)
and ``summary(report)``; :data:`KINDS` asks them in order, the text check last.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from mmengine.config import Config

from xtuner_rope.check import internvl, llava, preference, text
from xtuner_rope.check.runner import CheckRequest, start_config
from xtuner_rope.doctor.llava_stats import refuse_unserved_model

# Asked in this order; the first that applies measures the config.
KINDS: dict[str, ModuleType] = {
    preference.KIND: preference,  # DPO / ORPO / reward model: log-probs and scores
    internvl.KIND: internvl,  # InternVL_V1_5: the LLM's logits with the vision tokens written in
    llava.KIND: llava,  # LLaVAModel: the LLM's logits after the image expansion
    text.KIND: text,  # SFT: every other config
}


def kind_of(cfg: Config) -> ModuleType:
    """The kind module that measures the started config ``cfg``."""
    return next(kind for kind in KINDS.values() if kind.applies(cfg))


def run_check(
    config: str,
    cfg_options: dict | None = None,
    batches: int = 1,
    work_dir: str | Path = "work_dirs/check",
    dtype: str | None = None,
    max_documents: int = 8,
    new_tokens: int = 8,
) -> dict:
    """Measure isolation and equality on the config's own model and data; see the kind's module.

    Memory: one copy of the model, one set of gradients (``.grad`` ends as the difference), the
    reference logits of at most ``max_documents`` documents per batch (CPU), and activations of
    one cut batch or one document.

    The arguments are the command's options (:class:`~xtuner_rope.check.runner.CheckRequest`):
    ``dtype`` overrides the training dtype, rows are cut after ``max_documents`` documents per
    batch, ``new_tokens`` greedy tokens are generated. Returns the JSON-ready report, with
    ``verdict``, ``problems`` and ``exit_code``.
    """
    refuse_unserved_model(config)  # a model the start-up refuses, named
    cfg = start_config(config, cfg_options)
    request = CheckRequest(
        config, cfg_options, batches, Path(work_dir), dtype, max_documents, new_tokens
    )
    return kind_of(cfg).run(cfg, request)


def format_summary(report: dict) -> str:
    """The short text printed by ``xtuner-rope check``: the summary of the report's kind."""
    return KINDS[report.get("kind", text.KIND)].summary(report)
