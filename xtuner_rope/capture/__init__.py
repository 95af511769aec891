"""Captures of real ``xtuner train`` runs, and the measurements they share with ``xtuner-rope
check``."""
