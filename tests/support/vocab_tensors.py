"""The largest vocabulary-sized tensor an operation creates: proof that no ``[tokens, V]``
logits exist. Every aten op's outputs are seen (forward and backward, autograd's own too)."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class VocabTensors(TorchDispatchMode):
    """Inside the block, ``rows`` is the most elements / ``vocab`` of any output whose last
    dimension is ``vocab`` (a chunk ``[c, V]`` counts c, the row's logits ``[b, s, V]`` b * s;
    the head's weight and its gradient ``[V, H]`` are not logits; views and in-place results
    allocate nothing). Pick ``vocab`` unlike every other dimension of the model."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place op: no new buffer
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.shape[-1:] == (self.vocab,):
                self.rows = max(self.rows, math.prod(t.shape) // self.vocab)
        return out
