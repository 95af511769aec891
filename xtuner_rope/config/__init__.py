"""The config's start-up: what ``enable_xtuner_rope`` inspects, fixes and refuses, and re-checks.

- ``startup``: ``enable_xtuner_rope`` (XTuner's ``model_resource``), ``inspect_config`` and
  ``prepare_config`` over the registered findings functions (``register_findings``);
- findings modules, one concern each: ``multimodal`` (LLaVA), ``internvl``, ``sequence_parallel``,
  ``launch`` (DeepSpeed / launcher / devices), ``preference`` (DPO, ORPO, reward);
  the loss-normalization findings live with their hook (``xtuner_rope.hooks.loss_norm``);
- ``overrides``: the re-check of ``--cfg-options`` applied after the start-up.
"""
