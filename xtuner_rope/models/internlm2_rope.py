"""InternLM2's rotary module, validated: fp32 `inv_freq`, checked positions, shared tables.

A drop-in for XTuner's (and remote code's) default, linear and dynamic-NTK rotaries: `inv_freq`
stays fp32 after `module.bfloat16()`, dynamic NTK is stateless and per document in packed rows
(`models.rope_documents`), bad position ids are refused before any lookup.
"""

import weakref
from numbers import Integral

import torch
from torch import nn

from xtuner_rope.ops.document_plan import host_to_device_once
from xtuner_rope.ops.rope import check_position_ids, cos_sin_at, inv_freq
from xtuner_rope.ops.rope_documents import per_token_inv_freq

from .rope_documents import host_position_range, rotary_document_lengths

__all__ = ["ValidatedRotaryEmbedding"]

_SCALING_TYPES = (None, "linear", "dynamic")
# The last call's answers, shared by every layer's rotary (each layer holds its own module but
# gets the same position_ids tensor): cos/sin rows (keyed on that tensor's identity, version and
# the configuration) and dynamic NTK's per-token frequencies (keyed on the per-document lengths
# tensor, itself shared per forward; or, for a call without documents, on its length) and the
# cos/sin computed from them: once per forward.
_LAST_CALL = {"rows": None, "inv_freq": None, "dynamic": None, "ntk": None}
_BEYOND = "truncate or split the sequence, enable rope_scaling, or pass max_position= to allow more"


class ValidatedRotaryEmbedding(nn.Module):
    """InternLM2 rotary embedding with fp32 angles, checked positions and shared cos/sin tables.

    Args:
        dim (int): Rotary dimension h_d (even).
        max_position_embeddings (int): Context length the model was trained with.
        base (float): RoPE theta.
        scaling_type (str, optional): None, 'linear' or 'dynamic' (NTK).
        max_position (int, optional): Overrides the range limit on positions (see `limit`).

    Attributes:
        per_document (bool): Dynamic-NTK frequencies per document of a packed row (default).

    Raises:
        ValueError: Odd dim, unknown scaling type or non-positive scaling factor.
    """

    # fp32 (cos, sin) tables `[L, h_d]` per configuration and device, shared by every layer: a
    # 32-layer model holds one copy, not 32. L grows to the next power of two, never shrinks.
    _TABLES = {}

    def __init__(
        self,
        dim,
        max_position_embeddings=2048,
        base=10000,
        scaling_type=None,
        scaling_factor=1.0,
        max_position=None,
        device=None,
    ):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"dim (rotary head dim) must be a positive even number, got {dim}")
        if scaling_type not in _SCALING_TYPES:
            raise ValueError(
                f"scaling_type must be None, 'linear' or 'dynamic', got "
                f'{scaling_type!r}; check rope_scaling["type"] in the model config'
            )
        if scaling_factor <= 0:
            raise ValueError(f"scaling_factor must be positive, got {scaling_factor}")
        self.dim, self.base = dim, base
        self.max_position_embeddings = max_position_embeddings
        self.scaling_type, self.scaling_factor = scaling_type, scaling_factor
        self.max_position = max_position
        self.per_document = True
        self.register_buffer("inv_freq", inv_freq(base, dim, device), persistent=False)
        factor = scaling_factor if scaling_type == "linear" else 1.0
        self._tables = self._TABLES.setdefault((dim, float(base), float(factor)), {})

    @classmethod
    def from_module(cls, rotary_module, max_position=None):
        """Build one from an InternLM2 rotary module (xtuner's or remote code's), fp32 `inv_freq`.

        Raises:
            TypeError: The module lacks `dim`, `base`, `max_position_embeddings` or `inv_freq`.
        """
        needed = ("dim", "base", "max_position_embeddings", "inv_freq")
        missing = [name for name in needed if not hasattr(rotary_module, name)]
        if missing:
            raise TypeError(
                f"from_module expects an InternLM2 rotary embedding, got "
                f"{type(rotary_module).__name__} without {', '.join(missing)}"
            )
        module, name = rotary_module, type(rotary_module).__name__
        scaling_type = getattr(module, "scaling_type", None)
        if "Dynamic" in name or "Linear" in name:
            scaling_type = "dynamic" if "Dynamic" in name else "linear"
        return cls(
            module.dim,
            module.max_position_embeddings,
            module.base,
            scaling_type,
            getattr(module, "scaling_factor", 1.0),
            max_position,
            module.inv_freq.device,
        )

    def limit(self):
        """(limit, description): positions must be below limit; None means unbounded."""
        if self.max_position is not None:
            return self.max_position, f"max_position={self.max_position}"
        if self.scaling_type == "dynamic":
            return None, "dynamic NTK scaling"
        desc = f"max_position_embeddings={self.max_position_embeddings}"
        if self.scaling_type == "linear":
            limit = int(self.max_position_embeddings * self.scaling_factor)
            return limit, f"{desc} x linear scaling factor {self.scaling_factor}"
        return self.max_position_embeddings, desc

    def _apply(self, fn, recurse=True):
        # module.half()/.bfloat16() (DeepSpeed calls them) cast every floating buffer, and
        # upstream then computes angles from a bf16 inv_freq: recompute it in fp32 wherever
        # the buffer now lives.
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq(self.base, self.dim, self.inv_freq.device)
        return self

    def table_length(self, device):
        """Rows L of the cached cos/sin tables on `device` (0 if none yet)."""
        tables = self._tables.get(torch.device(device))
        return 0 if tables is None else tables[0].shape[0]

    def _table(self, device, length):
        """fp32 (cos, sin) `[L, h_d]` with L >= length, grown to a power of two on demand."""
        tables = self._tables.get(device)
        if tables is None or tables[0].shape[0] < length:
            rows = 1 << max(length - 1, 0).bit_length()
            divisor = self.scaling_factor if self.scaling_type == "linear" else None
            tables = cos_sin_at(
                torch.arange(rows, device=device), self.inv_freq.to(device), rows - 1, divisor
            )
            self._tables[device] = tables
        return tables

    def _ntk_inv_freq(self, seq_len, device):
        """Dynamic-NTK inverse frequencies for one call, in the reference's fp32 arithmetic."""
        # int64 on the device, as the reference's max() + 1; filled there (no host copy)
        seq_len = torch.full((), seq_len, dtype=torch.int64, device=device)
        factor, dim = self.scaling_factor, self.dim
        ratio = factor * seq_len / self.max_position_embeddings - (factor - 1)
        return inv_freq(self.base * ratio ** (dim / (dim - 2)), dim, device)

    def _config(self):
        return (self.dim, self.base, self.scaling_type, self.scaling_factor)

    def _cos_sin_at(self, position_ids, hi, b=1, dtype=torch.float32):
        """cos, sin `[..., h_d]` in `dtype` (computed in fp32) at integer `position_ids` `[...]`
        whose max is `hi` (`b`: rows of the activations, for `[1, s]` position ids)."""
        if self.scaling_type == "dynamic" and hi + 1 > self.max_position_embeddings:
            return self._dynamic_cos_sin(position_ids, hi, b, dtype)
        key = None
        if not position_ids.is_inference():  # inference tensors have no version counter
            key = (position_ids._version, tuple(position_ids.shape), dtype, self._config())
            last = _LAST_CALL["rows"]
            if last is not None and last[0]() is position_ids and last[1] == key:
                return last[2]
        cos, sin = self._table(position_ids.device, hi + 1)
        rows = position_ids.long()
        cos, sin = cos[rows].to(dtype), sin[rows].to(dtype)
        if key is not None:
            _LAST_CALL["rows"] = (weakref.ref(position_ids), key, (cos, sin))
        return cos, sin

    def _dynamic_cos_sin(self, position_ids, hi, b, dtype):
        """Dynamic NTK past the threshold: cos, sin `[b, s, h_d]` computed once per forward
        (keyed on the position ids and the frequencies, both shared by every layer)."""
        freqs = self._call_inv_freq(position_ids, hi, b)
        key = None
        if not position_ids.is_inference():
            key = (position_ids._version, tuple(position_ids.shape), dtype, hi, self._config())
            last = _LAST_CALL["dynamic"]
            if (
                last is not None
                and last[0]() is position_ids
                and last[1] == key
                and last[2] is freqs
            ):
                return last[3]
        cos, sin = cos_sin_at(position_ids, freqs, hi)
        cos, sin = cos.to(dtype), sin.to(dtype)
        if key is not None:
            _LAST_CALL["dynamic"] = (weakref.ref(position_ids), key, freqs, (cos, sin))
        return cos, sin

    def _call_inv_freq(self, position_ids, hi, b):
        """Dynamic NTK past the threshold: `[b, s, h_d/2]` per document in packed rows, else
        `[h_d/2]` for the call's length (upstream's choice; this call only, not sticky)."""
        device = position_ids.device
        lengths = None
        if self.per_document and position_ids.dim() == 2:
            s = position_ids.shape[1]
            lengths = rotary_document_lengths(self, position_ids, b, s, device, zero_start=False)
        if lengths is None:  # one set for the call's length, shared by every layer
            key = (hi + 1, str(device), self._config(), self.max_position_embeddings)
            last = _LAST_CALL["ntk"]
            if last is None or last[0] != key:
                last = _LAST_CALL["ntk"] = (key, self._ntk_inv_freq(hi + 1, device))
            return last[1]
        key = (lengths._version, self._config(), self.max_position_embeddings)
        last = _LAST_CALL["inv_freq"]
        if last is not None and last[0]() is lengths and last[1] == key:
            return last[2]
        freqs = per_token_inv_freq(
            lengths,
            self.inv_freq.to(device),
            self.max_position_embeddings,
            lambda n: self._ntk_inv_freq(n, device),
            device,
        )
        _LAST_CALL["inv_freq"] = (weakref.ref(lengths), key, freqs)
        return freqs

    @torch.no_grad()
    def forward(self, x, position_ids=None, seq_len=None, dtype=None):
        """cos and sin for `x`, by position ids (current InternLM2) or by length (old code); layers
        asking for the same ids and dtype in one forward share the tensors.

        Args:
            x (torch.Tensor): value_states `[b, n_kv, s, h_d]`; gives device, b, s (and dtype).
            position_ids (torch.Tensor, optional): Integer `[b, s]` or `[1, s]`; None means
                `arange(s)[None]`; a Python int is taken as `seq_len` (old positional call).
            seq_len (int, optional): Old signature: rows 0..seq_len-1 of the tables.
            dtype (torch.dtype, optional): Of cos and sin (computed in fp32); None: x's.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: cos, sin `[b, s, h_d]`, or `[seq_len, h_d]`.

        Raises:
            TypeError: x not a tensor, position_ids not an integer tensor, or seq_len not an int.
            ValueError: Bad position ids, seq_len <= 0 or beyond the limit, or both given.
        """
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(
                f"the rotary embedding needs x = value_states [b, n_kv, s, h_d] "
                f"(a tensor), got {got}"
            )
        if isinstance(position_ids, Integral) and not isinstance(position_ids, bool):
            position_ids, seq_len = None, position_ids
        if seq_len is not None:
            if position_ids is not None:
                raise ValueError("pass position_ids or seq_len to the rotary embedding, not both")
            seq_len = self._check_seq_len(seq_len)
            position_ids, hi = torch.arange(seq_len, device=x.device), seq_len - 1  # [s]
        else:
            if position_ids is None:  # built and checked on the CPU: no device sync
                position_ids = torch.arange(x.shape[-2])[None]  # [1, s]
            b, s = x.shape[0], x.shape[-2]
            known = host_position_range(self, position_ids, b, s, x.device)
            _, hi = check_position_ids(position_ids, b, s, *self.limit(), _BEYOND, known)
            # Host ids (the collate's): one queued copy per forward, shared by every layer.
            position_ids = host_to_device_once(position_ids, x.device)
        return self._cos_sin_at(position_ids, hi, x.shape[0], dtype or x.dtype)

    def _check_seq_len(self, seq_len):
        """seq_len of the old signature as a Python int, checked like position ids."""
        if not isinstance(seq_len, Integral) or isinstance(seq_len, bool):
            raise TypeError(f"seq_len must be a positive int, got {type(seq_len).__name__}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be a positive int, got {seq_len}")
        limit, desc = self.limit()
        if limit is not None and seq_len > limit:
            raise ValueError(
                f"seq_len={seq_len} is beyond the supported range of {limit} "
                f"positions ({desc}); {_BEYOND}"
            )
        return int(seq_len)

    def extra_repr(self):
        return (
            f"dim={self.dim}, base={self.base}, scaling_type={self.scaling_type}, "
            f"scaling_factor={self.scaling_factor}, limit={self.limit()[0]}"
        )
