"""What users run on a run's outputs: a recorded batch replayed, XTuner's tools on a checkpoint.

- ``replay``: the batch ``NonFiniteTripwireHook`` saved, replayed through the run's model
  (``tools/replay_batch.py``);
- ``xtuner_tools``: ``xtuner-rope convert pth_to_hf`` / ``convert merge`` / ``chat``, XTuner's own
  tools with the plugin loaded first.
"""
