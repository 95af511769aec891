"""The two KV-cache contracts of InternLM2 remote code, behind one pair of calls.

**Cache** (current code, XTuner's classes): a transformers ``Cache`` shared by all layers,
appended with ``update(k, v, self.layer_idx, ...)`` and returned. **Tuple** (first-generation
hub code, InternVL's copy): this layer's ``(k, v)``, each ``[b, n_kv, past, h_d]``, or None;
concatenated, ``(k, v)`` returned when ``use_cache``. Anything not a ``Cache`` is a tuple.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache


def _layer_idx(layer: nn.Module) -> int:
    """The index a ``Cache`` needs, or a TypeError naming the contract mismatch."""
    idx = getattr(layer, "layer_idx", None)
    if idx is None:
        raise TypeError(
            f"{type(layer).__name__} received a transformers Cache as past_key_value but has no "
            "layer_idx, so it cannot tell the Cache which layer it is. First-generation "
            "InternLM2 code keeps a (key, value) tuple per layer: pass the legacy tuple "
            "past_key_values (e.g. generate with a model whose _supports_cache_class is False), "
            "or set layer.layer_idx on every attention layer."
        )
    return idx


def _check_pair(layer: nn.Module, past_key_value) -> tuple[torch.Tensor, torch.Tensor]:
    """A tuple-contract past as ``(k, v)``, or a TypeError saying what arrived."""
    if (
        not isinstance(past_key_value, (tuple, list))
        or len(past_key_value) != 2
        or not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in past_key_value)
    ):
        got = type(past_key_value).__name__
        if isinstance(past_key_value, (tuple, list)):
            got = f"{got} of {len(past_key_value)} " + ", ".join(
                type(x).__name__ for x in past_key_value
            )
        raise TypeError(
            f"{type(layer).__name__}: past_key_value must be a transformers Cache, None, or "
            f"this layer's (key, value) pair of [b, n_kv, past, h_d] tensors; got {got}. "
            "Pass past_key_values[layer] (not the whole per-model tuple) to each layer."
        )
    return past_key_value[0], past_key_value[1]


def past_length(layer: nn.Module, past_key_value) -> int:
    """Tokens already cached for ``layer`` under either contract (0 without a cache).

    Raises:
        TypeError: A ``Cache`` given to a layer without ``layer_idx``, or a tuple-contract past
            that is not a ``(k, v)`` pair of 4-D tensors.
    """
    if isinstance(past_key_value, Cache):
        return past_key_value.get_seq_length(_layer_idx(layer))
    if past_key_value is None:
        return 0
    return _check_pair(layer, past_key_value)[0].shape[-2]


def extend_cache(
    layer: nn.Module,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key_value,
    use_cache: bool,
    cache_kwargs: dict,
):
    """Append this step's ``k``, ``v`` (``[b, n_kv, s, h_d]``, RoPE applied) to the layer's cache.

    Args:
        layer: The attention layer (its ``layer_idx`` for the Cache contract).
        past_key_value: A ``Cache``, a ``(k, v)`` pair of ``[b, n_kv, past, h_d]``, or None.
        use_cache: Whether the model wants a present back (tuple contract).

    Returns:
        ``(k, v, present)``: ``[b, n_kv, past + s, h_d]`` keys and values, and the layer's third
        output (the ``Cache``, or ``(k, v)`` / None).

    Raises:
        TypeError: As ``past_length``.
    """
    if isinstance(past_key_value, Cache):
        k, v = past_key_value.update(k, v, _layer_idx(layer), cache_kwargs)
        return k, v, past_key_value
    if past_key_value is not None:
        past_k, past_v = _check_pair(layer, past_key_value)
        k = torch.cat([past_k, k], dim=-2)  # [b, n_kv, past + s, h_d]
        v = torch.cat([past_v, v], dim=-2)
    return k, v, ((k, v) if use_cache else None)
