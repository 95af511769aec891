"""Validated RoPE for the transformers families with one rotary module per model.

Upstream's ``model.model.rotary_emb`` keeps a floating ``inv_freq`` (rounded by
``model.bfloat16()``), grows dynamic NTK for good and checks no position id.
``HFValidatedRotaryEmbedding`` keeps fp32 ``inv_freq`` and cos/sin (scalings applied), dynamic
NTK per call and per document, and raises for a bad position id; Phi-3's ``longrope`` uses
transformers' own frequencies, Cohere's layout is ``interleaved=True``.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys

import torch
from torch import nn

from xtuner_rope.ops.document_plan import host_to_device, host_to_device_once
from xtuner_rope.ops.positions import check_position_ids
from xtuner_rope.ops.rope import cos_sin_at
from xtuner_rope.ops.rope import inv_freq as default_inv_freq
from xtuner_rope.ops.rope_documents import per_token_inv_freq
from xtuner_rope.ops.rope_triton import triton_apply_active

from .rope_documents import host_position_range, rotary_document_lengths

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_ADVICE = (
    "truncate or split the sequence, enable rope_scaling, or pass max_position= to "
    "patch_hf_model to allow more"
)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency bands: long wavelengths divided by ``factor``, short ones kept, a
    linear blend (in ``original_max_position_embeddings / wavelength``) in between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq  # [h_d/2]
    blend = (context / wavelength - low) / (high - low)  # 0 at the long edge, 1 at the short one
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    out = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    middle = (wavelength <= context / low) & (wavelength >= context / high)
    return torch.where(middle, blended, out)


def _yarn_inv_freq(base: float, dim: int, max_positions: int, scaling: dict, device=None):
    """YaRN: interpolate (divide by ``factor``) the slow dims, extrapolate the fast ones, with a
    linear ramp over the dims that turn between ``beta_slow`` and ``beta_fast`` times."""
    factor = scaling["factor"]

    def dim_of(turns: float) -> float:  # dim index whose wavelength fits `turns` times
        return dim * math.log(max_positions / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(scaling.get("beta_fast") or 32)), 0)
    high = min(math.ceil(dim_of(scaling.get("beta_slow") or 1)), dim - 1)
    high = high + 0.001 if high == low else high  # a one-dim ramp still needs a slope
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(device)  # [h_d/2] weight of the unscaled (extrapolated) frequency
    powers = base ** (torch.arange(0, dim, 2).float().to(device) / dim)  # [h_d/2]
    return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep


class HFValidatedRotaryEmbedding(nn.Module):
    """Rotary embedding of a transformers family's model (``models.families``), validated, fp32.

    Args:
        config: The model's ``PretrainedConfig`` (theta, head dim, positions, ``rope_scaling``).
        max_position: Optional override of the position limit (see ``limit``).
        interleaved: cos/sin as ``[f0, f0, f1, f1, ...]`` (Cohere).
        longrope_per_call: The upstream class switches LongRoPE factors per call (Phi-3's).

    Attributes:
        per_document: Length-dependent frequencies per document of a packed row (default).

    Raises:
        ValueError: A ``rope_type`` outside ``SUPPORTED_ROPE_TYPES``.
    """

    def __init__(
        self,
        config,
        max_position: int | None = None,
        device=None,
        interleaved: bool = False,
        longrope_per_call: bool = True,
    ):
        super().__init__()
        self.config, self.interleaved = config, interleaved
        self.per_document = True
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        self.rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        longrope_unsized = self.rope_type == "longrope" and not (
            getattr(config, "original_max_position_embeddings", None) or scaling.get("factor")
        )
        if self.rope_type not in SUPPORTED_ROPE_TYPES or longrope_unsized:
            raise ValueError(
                f"rope_scaling rope_type={self.rope_type!r} of {type(config).__name__} is not "
                f"supported by the validated RoPE (supported: {', '.join(SUPPORTED_ROPE_TYPES)}; "
                "longrope with original_max_position_embeddings or a factor, as Phi-3's); "
                "train without ValidatedRoPEHook / patch_hf_model for this model."
            )
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        self.base = float(config.rope_theta)
        self.max_position_embeddings = config.max_position_embeddings
        self.scaling, self.max_position = scaling, max_position
        self.attention_scaling = 1.0
        if self.rope_type == "yarn":
            self.attention_scaling = (
                scaling.get("attention_factor") or 0.1 * math.log(scaling["factor"]) + 1.0
            )
        if self.rope_type == "longrope":  # transformers' own: its attention factor too
            self.attention_scaling = self._longrope(None, device)[1]
            self.original = (
                getattr(config, "original_max_position_embeddings", None)
                or config.max_position_embeddings
            )
        # Where upstream's frequencies depend on the length served, and up to which length
        # they do not change (transformers: `_dynamic_frequency_update` grows past
        # max_position_embeddings; `_longrope_frequency_update` switches past the original).
        self.threshold = None
        if self.rope_type == "dynamic":
            self.threshold = self.max_position_embeddings
        elif self.rope_type == "longrope" and longrope_per_call:
            self.threshold = self.original
        self.register_buffer("inv_freq", self.inv_freq_at(None, device), persistent=False)

    @classmethod
    def from_module(
        cls, rotary: nn.Module, max_position: int | None = None, interleaved: bool = False
    ):
        """Build one from an upstream rotary module (its ``config``, on its ``inv_freq`` device)."""
        per_call = hasattr(type(rotary), "_longrope_frequency_update")
        return cls(rotary.config, max_position, rotary.inv_freq.device, interleaved, per_call)

    def _longrope(self, seq_len: int | None, device=None):
        """transformers' longrope (fp32): short factors up to ``original_max_position_embeddings``
        positions, long factors beyond (``seq_len`` is the length served)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](self.config, device, seq_len=seq_len)
        return inv_freq.float(), attention

    def inv_freq_at(self, seq_len: int | None, device=None) -> torch.Tensor:
        """fp32 inverse frequencies ``[h_d/2]``; ``seq_len`` (dynamic NTK only) is the length
        the frequencies must serve, at least ``max_position_embeddings``."""
        scaling, dim = self.scaling, self.dim
        if self.rope_type == "longrope":
            return self._longrope(seq_len, device)[0]
        if self.rope_type == "yarn":
            return _yarn_inv_freq(self.base, dim, self.max_position_embeddings, scaling, device)
        base = self.base
        if self.rope_type == "dynamic":
            length = max(seq_len or 0, self.max_position_embeddings)
            factor = scaling["factor"]
            stretch = factor * length / self.max_position_embeddings - (factor - 1)
            base = base * stretch ** (dim / (dim - 2))
        inv_freq = default_inv_freq(base, dim, device)
        if self.rope_type == "linear":
            return inv_freq / scaling["factor"]
        if self.rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, scaling)
        return inv_freq

    def length_inv_freq(self, seq_len: int, device=None) -> torch.Tensor:
        """fp32 inverse frequencies upstream computes for ``seq_len`` (> ``threshold``) tokens:
        transformers' own function, called as ``_dynamic_frequency_update`` calls it, on the host,
        sent to ``device`` in one non-blocking copy."""
        if self.rope_type == "longrope":
            freqs = self._longrope(self.original + 1)[0]
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            length = torch.tensor(seq_len, dtype=torch.int64)
            freqs = ROPE_INIT_FUNCTIONS["dynamic"](self.config, None, seq_len=length)[0].float()
        return host_to_device(freqs, torch.device(device or "cpu"))

    def limit(self) -> tuple[int | None, str]:
        """(limit, description): positions must be below limit; None means unbounded."""
        if self.max_position is not None:
            return self.max_position, f"max_position={self.max_position}"
        desc = f"max_position_embeddings={self.max_position_embeddings}"
        if self.rope_type == "dynamic":
            return None, "dynamic NTK scaling"
        if self.rope_type in ("default", "longrope"):  # longrope: max_position_embeddings
            return self.max_position_embeddings, desc
        original = (
            self.scaling.get("original_max_position_embeddings") or self.max_position_embeddings
        )
        scaled = int(original * self.scaling["factor"])
        return max(scaled, self.max_position_embeddings), (
            f"{desc}, {self.rope_type} scaling factor {self.scaling['factor']} x {original}"
        )

    def _apply(self, fn, recurse=True):
        # model.bfloat16() / .half() (DeepSpeed calls them) cast every floating buffer:
        # recompute inv_freq in fp32 wherever the buffer now lives.
        super()._apply(fn, recurse)
        self.inv_freq = self.inv_freq_at(None, self.inv_freq.device)
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None):
        """fp32 cos and sin ``[b, s, h_d]`` (times the yarn attention scaling) for the tokens
        of ``x`` ``[b, s, hidden]``, whatever its dtype, at ``position_ids`` (integer ``[b, s]`` or
        ``[1, s]``; None: ``arange(s)[None]``).

        Raises:
            TypeError: position_ids not an integer tensor.
            ValueError: Bad position ids (see ``check_position_ids``).
        """
        b, s = x.shape[:2]
        if position_ids is None:  # built and checked on the CPU: no device sync
            position_ids = torch.arange(s)[None]  # [1, s]
        known = host_position_range(self, position_ids, b, s, x.device)
        _, hi = check_position_ids(position_ids, b, s, *self.limit(), _ADVICE, known)
        inv_freq = self.inv_freq.to(x.device)
        if self.threshold is not None and hi + 1 > self.threshold:
            inv_freq = self._call_inv_freq(position_ids, b, s, hi, x.device)
        positions = host_to_device_once(position_ids, x.device)  # host ids: a queued copy
        cos, sin = cos_sin_at(positions, inv_freq, hi)  # [b, s, h_d]
        if self.interleaved:  # [f0, f1, .., f0, f1, ..] -> [f0, f0, f1, f1, ..]
            half = cos.shape[-1] // 2
            cos, sin = (t[..., :half].repeat_interleave(2, dim=-1) for t in (cos, sin))
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    def _call_inv_freq(self, position_ids, b: int, s: int, hi: int, device) -> torch.Tensor:
        """A call reaching past ``threshold``: ``[b, s, h_d/2]`` frequencies of each token's
        document in packed rows, else ``[h_d/2]`` of the call's length (upstream's choice; this
        call only: no sticky growth)."""
        lengths = None
        if self.per_document:
            lengths = rotary_document_lengths(self, position_ids, b, s, device, zero_start=True)
        if lengths is None:
            return self.length_inv_freq(hi + 1, device)
        return per_token_inv_freq(
            lengths,
            self.inv_freq.to(device),
            self.threshold,
            functools.partial(self.length_inv_freq, device=device),
            device,
        )

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, base={self.base}, rope_type={self.rope_type}, "
            f"attention_scaling={self.attention_scaling}, limit={self.limit()[0]}"
        )


def patch_hf_fp32_rotation(module_name: str, interleaved: bool = False) -> bool:
    """Let a transformers family's ``apply_rotary_pos_emb`` rotate bf16/fp16 q, k in fp32.

    With fp32 cos/sin, transformers 4.48's apply would promote q and k to fp32 (fp32 KV cache,
    SDPA refusing mixed dtypes): the wrapper rotates with ``rope.apply_rotary_pos_emb`` in q's
    dtype; other calls go to the original, rebound wherever bound by name (XTuner's
    ``dispatch/``). Cohere (``interleaved``) upcasts itself: only Triton-served calls are taken.

    ``module_name``: the family's modeling module. True if installed now, False if it already was.
    """
    module = importlib.import_module(module_name)
    original = module.apply_rotary_pos_emb
    if getattr(original, "_xtuner_rope_fp32", False):
        return False

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        if cos.dtype == torch.float32 and (
            triton_apply_active(q) or (q.dtype != torch.float32 and not interleaved)
        ):
            from xtuner_rope.ops.rope import apply_rotary_pos_emb as fp32_apply

            return fp32_apply(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
        return original(q, k, cos, sin, position_ids, unsqueeze_dim)

    apply_rotary_pos_emb._xtuner_rope_fp32 = True
    for loaded in list(sys.modules.values()):
        namespace = getattr(loaded, "__dict__", None)
        if namespace is not None and namespace.get("apply_rotary_pos_emb") is original:
            loaded.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True
