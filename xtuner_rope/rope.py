"""RoPE math for InternLM2: fp32 frequencies, checked position ids, cos/sin tables, apply.

Drop-in replacements for XTuner 0.2.0's InternLM2 rotary classes and `apply_rotary_pos_emb`
that keep `inv_freq` in fp32 after `module.bfloat16()`, keep dynamic NTK stateless, reject bad
position ids before any kernel sees them and rotate in fp32 whatever the input dtype.
"""

import contextlib
from numbers import Integral

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from xtuner_rope.positions import check_position_ids
from xtuner_rope.rotate import rotate, use_fused_apply

__all__ = ['FP32_EXACT_POSITIONS', 'ValidatedRotaryEmbedding', 'apply_rotary_pos_emb',
           'check_position_ids', 'cos_sin_at', 'rotate_half', 'use_fused_apply']

_SCALING_TYPES = (None, 'linear', 'dynamic')
_BEYOND = ('truncate or split the sequence, enable rope_scaling, or pass max_position= to '
           'allow more')


def _no_autocast(device):
    """Autocast off on `device` (where it exists): angles are computed in fp32."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def _inv_freq(base, dim, device=None):
    """fp32 inverse frequencies `[h_d/2]`, written as upstream does so both round alike."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (base**exponents)


def _cos_sin(positions, inv_freq):
    """cos and sin `[..., h_d]` for float `positions` `[...]` and `inv_freq` `[h_d/2]`."""
    with _no_autocast(positions.device):
        # One rounding per angle (fp32: like the reference's outer product).
        freqs = positions[..., None] * inv_freq  # [..., h_d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., h_d]
        return emb.cos(), emb.sin()


# fp32 holds every integer below 2**24, not all above (2**24 + 1 rounds to 2**24).
FP32_EXACT_POSITIONS = 1 << 24


def cos_sin_at(position_ids, inv_freq, hi, divisor=None):
    """fp32 cos and sin `[..., h_d]` at integer `position_ids` `[...]` whose max is `hi`.

    Below `FP32_EXACT_POSITIONS` the angles are computed in fp32 exactly as the reference
    does. From there on fp32 cannot hold every position: tokens would share angles and cos/sin
    be off by up to ~1 (reachable with dynamic NTK, which has no position limit), so those
    calls compute the angles in fp64 from the same fp32 `inv_freq` and return fp32 cos/sin.

    Args:
        position_ids (torch.Tensor): Integer positions `[...]`.
        inv_freq (torch.Tensor): fp32 inverse frequencies `[h_d/2]`.
        hi (int): The largest position.
        divisor (float, optional): Positions are divided by it first (linear scaling).
    """
    dtype = torch.float32 if hi < FP32_EXACT_POSITIONS else torch.float64
    positions = position_ids.to(dtype)
    if divisor is not None:
        positions = positions / divisor  # the reference divides first
    cos, sin = _cos_sin(positions, inv_freq.to(dtype))
    return cos.float(), sin.float()


class ValidatedRotaryEmbedding(nn.Module):
    """InternLM2 rotary embedding with fp32 angles, checked positions and shared cos/sin tables.

    Args:
        dim (int): Rotary dimension h_d (even).
        max_position_embeddings (int): Context length the model was trained with.
        base (float): RoPE theta.
        scaling_type (str, optional): None, 'linear' or 'dynamic' (NTK).
        scaling_factor (float): Factor of the scaling.
        max_position (int, optional): Overrides the range limit on positions (see `limit`).
        device (torch.device, optional): Device of `inv_freq`.

    Raises:
        ValueError: Odd dim, unknown scaling type or non-positive scaling factor.
    """

    # fp32 (cos, sin) tables `[L, h_d]` per configuration and device, shared by every layer: a
    # 32-layer model holds one copy, not 32. L grows to the next power of two, never shrinks.
    _TABLES = {}

    def __init__(self, dim, max_position_embeddings=2048, base=10000, scaling_type=None,
                 scaling_factor=1.0, max_position=None, device=None):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f'dim (rotary head dim) must be a positive even number, got {dim}')
        if scaling_type not in _SCALING_TYPES:
            raise ValueError(f"scaling_type must be None, 'linear' or 'dynamic', got "
                             f'{scaling_type!r}; check rope_scaling["type"] in the model config')
        if scaling_factor <= 0:
            raise ValueError(f'scaling_factor must be positive, got {scaling_factor}')
        self.dim, self.base = dim, base
        self.max_position_embeddings = max_position_embeddings
        self.scaling_type, self.scaling_factor = scaling_type, scaling_factor
        self.max_position = max_position
        self.register_buffer('inv_freq', _inv_freq(base, dim, device), persistent=False)
        factor = scaling_factor if scaling_type == 'linear' else 1.0
        self._tables = self._TABLES.setdefault((dim, float(base), float(factor)), {})

    @classmethod
    def from_module(cls, rotary_module, max_position=None):
        """Build one from an InternLM2 rotary module (xtuner's or a remote-code copy).

        The scaling type comes from the class name ('Linear', 'Dynamic') or a `scaling_type`
        attribute; `inv_freq` is recomputed in fp32 on the device of the module's one.

        Raises:
            TypeError: The module lacks `dim`, `base`, `max_position_embeddings` or `inv_freq`.
        """
        needed = ('dim', 'base', 'max_position_embeddings', 'inv_freq')
        missing = [name for name in needed if not hasattr(rotary_module, name)]
        if missing:
            raise TypeError(f'from_module expects an InternLM2 rotary embedding, got '
                            f'{type(rotary_module).__name__} without {", ".join(missing)}')
        module, name = rotary_module, type(rotary_module).__name__
        scaling_type = getattr(module, 'scaling_type', None)
        if 'Dynamic' in name or 'Linear' in name:
            scaling_type = 'dynamic' if 'Dynamic' in name else 'linear'
        return cls(module.dim, module.max_position_embeddings, module.base, scaling_type,
                   getattr(module, 'scaling_factor', 1.0), max_position, module.inv_freq.device)

    def limit(self):
        """(limit, description): positions must be below limit; None means unbounded."""
        if self.max_position is not None:
            return self.max_position, f'max_position={self.max_position}'
        if self.scaling_type == 'dynamic':
            return None, 'dynamic NTK scaling'
        desc = f'max_position_embeddings={self.max_position_embeddings}'
        if self.scaling_type == 'linear':
            limit = int(self.max_position_embeddings * self.scaling_factor)
            return limit, f'{desc} x linear scaling factor {self.scaling_factor}'
        return self.max_position_embeddings, desc

    def _apply(self, fn, recurse=True):
        # module.half()/.bfloat16() (DeepSpeed calls them) cast every floating buffer, and
        # upstream then computes angles from a bf16 inv_freq: recompute it in fp32 wherever
        # the buffer now lives.
        super()._apply(fn, recurse)
        self.inv_freq = _inv_freq(self.base, self.dim, self.inv_freq.device)
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
            divisor = self.scaling_factor if self.scaling_type == 'linear' else None
            tables = cos_sin_at(torch.arange(rows, device=device), self.inv_freq.to(device),
                                rows - 1, divisor)
            self._tables[device] = tables
        return tables

    def _ntk_inv_freq(self, seq_len, device):
        """Dynamic-NTK inverse frequencies for one call, in the reference's fp32 arithmetic."""
        seq_len = torch.tensor(seq_len, device=device)  # int64, as the reference's max() + 1
        factor, dim = self.scaling_factor, self.dim
        ratio = factor * seq_len / self.max_position_embeddings - (factor - 1)
        return _inv_freq(self.base * ratio ** (dim / (dim - 2)), dim, device)

    def _cos_sin_at(self, position_ids, hi):
        """fp32 cos, sin `[..., h_d]` at integer `position_ids` `[...]` whose max is `hi`."""
        if self.scaling_type == 'dynamic' and hi + 1 > self.max_position_embeddings:
            inv_freq = self._ntk_inv_freq(hi + 1, position_ids.device)
            return cos_sin_at(position_ids, inv_freq, hi)
        cos, sin = self._table(position_ids.device, hi + 1)
        position_ids = position_ids.long()
        return cos[position_ids], sin[position_ids]

    @torch.no_grad()
    def forward(self, x, position_ids=None, seq_len=None):
        """cos and sin for `x`, by position ids (current InternLM2) or by length (old code).

        Args:
            x (torch.Tensor): value_states `[b, n_kv, s, h_d]`; gives dtype, device, b and s.
            position_ids (torch.Tensor, optional): Integer `[b, s]` or `[1, s]`; None means
                `arange(s)[None]`. A Python int is taken as `seq_len` (old positional call).
            seq_len (int, optional): Old signature: return rows 0..seq_len-1 of the tables.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: cos, sin in x.dtype, `[b, s, h_d]` (b of
            position_ids), or `[seq_len, h_d]` with seq_len.

        Raises:
            TypeError: x not a tensor, position_ids not an integer tensor, or seq_len not an
                int.
            ValueError: Bad position ids (see `check_position_ids`), seq_len <= 0 or beyond
                the limit, or both position_ids and seq_len given.
        """
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f'the rotary embedding needs x = value_states [b, n_kv, s, h_d] '
                            f'(a tensor), got {got}')
        if isinstance(position_ids, Integral) and not isinstance(position_ids, bool):
            position_ids, seq_len = None, position_ids
        if seq_len is not None:
            if position_ids is not None:
                raise ValueError('pass position_ids or seq_len to the rotary embedding, not both')
            seq_len = self._check_seq_len(seq_len)
            position_ids, hi = torch.arange(seq_len, device=x.device), seq_len - 1  # [s]
        else:
            if position_ids is None:  # built and checked on the CPU: no device sync
                position_ids = torch.arange(x.shape[-2])[None]  # [1, s]
            _, hi = check_position_ids(position_ids, x.shape[0], x.shape[-2], *self.limit(),
                                       _BEYOND)
            position_ids = position_ids.to(x.device)
        cos, sin = self._cos_sin_at(position_ids, hi)
        return cos.to(x.dtype), sin.to(x.dtype)

    def _check_seq_len(self, seq_len):
        """seq_len of the old signature as a Python int, checked like position ids."""
        if not isinstance(seq_len, Integral) or isinstance(seq_len, bool):
            raise TypeError(f'seq_len must be a positive int, got {type(seq_len).__name__}')
        if seq_len <= 0:
            raise ValueError(f'seq_len must be a positive int, got {seq_len}')
        limit, desc = self.limit()
        if limit is not None and seq_len > limit:
            raise ValueError(f'seq_len={seq_len} is beyond the supported range of {limit} '
                             f'positions ({desc}); {_BEYOND}')
        return int(seq_len)

    def extra_repr(self):
        return (f'dim={self.dim}, base={self.base}, scaling_type={self.scaling_type}, '
                f'scaling_factor={self.scaling_factor}, limit={self.limit()[0]}')


def rotate_half(x):
    """Rotate half the hidden dims: `[x1, x2] -> [-x2, x1]` on the last dim `h_d`."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class _ApplyRotary(torch.autograd.Function):
    """Rotate q and k in fp32; saves only cos/sin, the backward applies the transpose."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(q, cos, sin, False), rotate(k, cos, sin, False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        # The map is linear in q (and k): its vector-Jacobian product is its transpose.
        grad_q = rotate(grad_q, cos, sin, True) if ctx.needs_input_grad[0] else None
        grad_k = rotate(grad_k, cos, sin, True) if ctx.needs_input_grad[1] else None
        return grad_q, grad_k, None, None


def _table_rows(cos, sin, q, position_ids, unsqueeze_dim):
    """Pick rows of `[L, h_d]` tables (older remote code) as `[b, s, h_d]` cos/sin."""
    seq_len = q.shape[2 if unsqueeze_dim == 1 else 1]  # q is [b, n_h, s, h_d] or [b, s, n_h, h_d]
    if position_ids is None:
        position_ids = torch.arange(seq_len)[None]  # [1, s]
    desc = f'rows of the {cos.shape[0]}-row cos/sin table'
    check_position_ids(position_ids, q.shape[0], seq_len, cos.shape[0], desc,
                       'get longer tables from the rotary embedding (larger seq_len)')
    position_ids = position_ids.to(cos.device).long()
    return cos[position_ids], sin[position_ids]  # [b, s, h_d]


def _check_apply_inputs(q, k, cos, sin, unsqueeze_dim):
    """Types and shapes of `apply_rotary_pos_emb`'s inputs; shape reads only (no device sync)."""
    for name, t in (('q', q), ('k', k), ('cos', cos), ('sin', sin)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f'apply_rotary_pos_emb: {name} must be a floating-point tensor, got '
                            f'{got}; pass the rotary embedding\'s cos/sin and the projected q/k')
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4:
        raise ValueError(f'apply_rotary_pos_emb: expected 4-D q/k with the heads at '
                         f'unsqueeze_dim 1 ([b, n_h, s, h_d]) or 2 ([b, s, n_h, h_d]), got q '
                         f'{tuple(q.shape)}, k {tuple(k.shape)}, unsqueeze_dim={unsqueeze_dim!r}')
    head_dim, s_dim = q.shape[-1], 3 - unsqueeze_dim
    b, s = q.shape[0], q.shape[s_dim]
    if head_dim % 2 or k.shape[-1] != head_dim or cos.shape[-1] != head_dim:
        raise ValueError(f'apply_rotary_pos_emb needs one even head dim h_d, got q '
                         f'{tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}')
    if k.shape[0] != b or k.shape[s_dim] != s:
        raise ValueError(f'apply_rotary_pos_emb: k {tuple(k.shape)} must have the batch {b} and '
                         f'sequence length {s} of q {tuple(q.shape)}')
    if sin.shape != cos.shape:
        raise ValueError(f'apply_rotary_pos_emb: sin {tuple(sin.shape)} must have the shape of '
                         f'cos {tuple(cos.shape)}')
    if cos.dim() == 3 and (cos.shape[0] not in (1, b) or cos.shape[1] != s):
        raise ValueError(f'apply_rotary_pos_emb: cos/sin {tuple(cos.shape)} do not match q '
                         f'{tuple(q.shape)}: expected [1, {s}, {head_dim}] or [{b}, {s}, '
                         f'{head_dim}] (one row per token); compute them from these position_ids')
    if cos.dim() not in (2, 3):
        raise ValueError(f'apply_rotary_pos_emb: cos/sin must be [b, s, h_d] or [L, h_d] '
                         f'tables, got {tuple(cos.shape)}')


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Apply rotary position embedding to q and k; arithmetic in fp32 whatever the dtypes.

    Args:
        q (torch.Tensor): Queries `[b, n_h, s, h_d]` (`[b, s, n_h, h_d]` with unsqueeze_dim=2).
        k (torch.Tensor): Keys `[b, n_kv, s, h_d]` (or `[b, s, n_kv, h_d]`).
        cos (torch.Tensor): `[b, s, h_d]`, or `[L, h_d]` tables of older remote code, whose rows
            are then picked by position_ids (rows 0..s-1 when None).
        sin (torch.Tensor): Same shape as cos.
        position_ids (torch.Tensor, optional): `[b, s]`; only used with `[L, h_d]` tables.
        unsqueeze_dim (int): Heads dim of q/k, where cos/sin get a size-1 dim to broadcast.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: Rotated q and k in their own dtypes. No gradient
        flows into cos/sin (they come from no-grad rotary modules).

    Raises:
        TypeError: q, k, cos or sin not a floating-point tensor.
        ValueError: Odd or mismatched head dims; q/k/cos/sin of different batch or length
            (cos/sin of batch 1 broadcast); bad position ids for `[L, h_d]` tables.
    """
    _check_apply_inputs(q, k, cos, sin, unsqueeze_dim)
    if cos.dim() == 2:
        cos, sin = _table_rows(cos, sin, q, position_ids, unsqueeze_dim)
    cos = cos.float().unsqueeze(unsqueeze_dim)  # [b, 1, s, h_d] for unsqueeze_dim=1
    sin = sin.float().unsqueeze(unsqueeze_dim)  # [b, 1, s, h_d] for unsqueeze_dim=1
    return _ApplyRotary.apply(q, k, cos, sin)
