"""The maintainer's tools: scripts, benches, the config zoo and the sample-data generator.

Not part of the wheel (``setup.cfg`` packages only ``xtuner_rope``) and never imported by it.
A package so that the tools and the tests import ``tools.zoo`` and ``tools.sample_data`` from a
checkout: run them from the repository root (``python -m tools.zoo ...``;
``tests/conftest.py`` puts the root first on ``sys.path``).
"""
