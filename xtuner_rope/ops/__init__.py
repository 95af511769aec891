"""Family-free math on torch alone: positions, packing plans, boundaries, RoPE, packed attention.

Nothing here knows MMEngine, XTuner or a model family; ``batch/``, ``models/`` and the face
build on it.
"""
