"""The config's start-up: what ``enable_xtuner_rope`` inspects, fixes and refuses, and re-checks.

- ``startup``: ``enable_xtuner_rope`` (XTuner's ``model_resource``), ``inspect_config`` and
  ``prepare_config`` over the registered findings functions (``register_findings``, at the named
  slots of ``findings.SLOTS``);
- ``fields``: reading a config without building it (``type_name``, its datasets, its packing);
- findings modules, one topic each: ``packing`` (boundaries recorded and kept, nothing dropped,
  the stock ``use_varlen_attn``), ``runtime`` (the plugin's hooks, AMP on CPU),
  ``sequence_parallel``, ``families`` (flash-attn, unserved families), ``checkpoint_findings``
  (a ``config.json`` that cannot be read), ``rope_scaling`` (a ``rope_scaling`` no model
  computes), ``multimodal`` (LLaVA), ``llava_tower`` (LLaVA against its vision tower),
  ``internvl``, ``frameworks`` (XTuner's Hugging Face ``Trainer`` configs), ``moss``
  (``MOSSSFTDataset`` data files its cache would overwrite), ``launch`` (DeepSpeed / launcher / devices), ``heldout`` (the held-out evaluation, a
  package: its findings, ``files`` (a missing or empty held-out file), ``models`` (which
  metric serves which model, held-out pairs) and ``shortcut`` (``heldout = dict(...)``)), ``preference`` (DPO, ORPO, reward),
  ``patch_needs`` (a feature whose third-party patch ``compat`` skipped here),
  ``optimizer_state`` (``save_optimizer`` turned on), ``loss`` (``loss_normalization``),
  ``accumulation`` (checkpoint intervals at accumulation-window boundaries);
- ``overrides``: the re-check of ``--cfg-options`` applied after the start-up.

Importing the package registers its findings modules: ``inspect_config`` never runs without
the start-up's own findings, whatever imported it first.
"""

from . import (
    checkpoint_findings,
    families,
    frameworks,
    heldout,
    internvl,
    launch,
    llava_tower,
    moss,
    multimodal,
    optimizer_state,
    packing,
    patch_needs,
    preference,
    rope_scaling,
    runtime,
    sequence_parallel,
)

__all__ = [
    "checkpoint_findings",
    "families",
    "frameworks",
    "heldout",
    "internvl",
    "launch",
    "llava_tower",
    "moss",
    "multimodal",
    "optimizer_state",
    "packing",
    "patch_needs",
    "preference",
    "rope_scaling",
    "runtime",
    "sequence_parallel",
]
