"""XTuner's own commands around a run, with the plugin loaded and a real exit status: training
itself, a recorded batch replayed, XTuner's tools on a checkpoint.

- ``xtuner_train``: ``xtuner-rope train``, XTuner's launch of ``xtuner train`` with the
  training's exit status;

- ``replay``: the batch ``NonFiniteTripwireHook`` saved, replayed through the run's model
  (``tools/replay_batch.py``);
- ``xtuner_tools``: ``xtuner-rope convert pth_to_hf`` / ``convert merge`` / ``chat``, XTuner's own
  tools with the plugin loaded first;
- ``internvl_convert``: ``convert pth_to_hf`` of XTuner's ``InternVL_V1_5``, which XTuner's tool
  cannot convert: the official InternVL layout, in the dtype asked, exact;
- ``xtuner_parsers``: those tools' and ``train``'s own ``parse_args``, read from XTuner's files,
  answering ``-h`` and usage errors without importing XTuner.
"""
