"""Crash-safe runner checkpoints: loaded weights-only, written whole, resumed only when complete.

docs/architecture.md lists the modules; ``compat.runner_checkpoints`` hooks them in.
"""
