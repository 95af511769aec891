"""Crash-safe runner checkpoints: loaded weights-only, written whole, resumed only when complete.

``loading`` (the allow-listed ``weights_only`` load, trusted paths), ``complete`` (is a checkpoint
file or DeepSpeed folder complete, the newest complete one), ``world`` (a ZeRO checkpoint resumed
on another number of processes), ``atomic`` (a temporary name, fsync, ``os.replace``) and
``auto_resume`` (what MMEngine's auto-resume loads). ``compat.runner_checkpoints`` hooks them
into MMEngine, XTuner and DeepSpeed.
"""
