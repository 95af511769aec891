"""XTuner's own commands around a run (train, convert, merge, chat, a batch replayed), with the
plugin loaded and a real exit status."""
