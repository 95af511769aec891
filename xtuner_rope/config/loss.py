"""Start-up findings and readers of the loss settings: ``loss_normalization``, ``chunked_loss``.

``loss_normalization``: ``"token"`` (default), ``"dialogue"`` or ``"micro_batch"`` (XTuner's);
``chunked_loss``: ``True`` (default), ``False`` or tokens per chunk. Others are refused.
"""

from __future__ import annotations

from xtuner_rope.compat.mmengine_config import config_dict

from .findings import Finding
from .startup import register_findings

__all__ = [
    "CHUNKED_LOSS_KEY",
    "CHUNKED_LOSS_OPT_OUT",
    "DIALOGUE",
    "LOSS_NORMALIZATIONS",
    "LOSS_NORMALIZATION_KEY",
    "MICRO_BATCH",
    "TOKEN",
    "chunked_loss_findings",
    "chunked_loss_setting",
    "loss_normalization",
    "loss_normalization_findings",
]

# The one setting (top level of the config) and its values.
LOSS_NORMALIZATION_KEY = "loss_normalization"
TOKEN, MICRO_BATCH, DIALOGUE = "token", "micro_batch", "dialogue"
LOSS_NORMALIZATIONS = (TOKEN, MICRO_BATCH, DIALOGUE)


def loss_normalization(cfg: object) -> str:
    """The config's ``loss_normalization`` (default ``"token"``), checked.

    Raises:
        ValueError: an unknown value; the message lists the accepted ones.
    """
    # MMEngine's Config is no Mapping, but has ``get``; a runner built in code has a dict.
    mode = cfg.get(LOSS_NORMALIZATION_KEY, TOKEN) if hasattr(cfg, "get") else TOKEN
    if mode not in LOSS_NORMALIZATIONS:
        raise ValueError(
            f"{LOSS_NORMALIZATION_KEY}: expected one of {LOSS_NORMALIZATIONS}, got "
            f"{mode!r}. Set it at the top level of the config, or delete it for "
            f'the default "{TOKEN}".'
        )
    return mode


@register_findings("loss")
def loss_normalization_findings(cfg) -> list:
    """Start-up check (``startup.inspect_config``): an unknown ``loss_normalization`` is a
    conflict, refused before anything is built."""
    mode = config_dict(cfg).get(LOSS_NORMALIZATION_KEY, TOKEN)
    if mode in LOSS_NORMALIZATIONS:
        return []
    return [
        Finding(
            LOSS_NORMALIZATION_KEY,
            f"expected one of {LOSS_NORMALIZATIONS}, got {mode!r}",
            f'set {LOSS_NORMALIZATION_KEY} = "{TOKEN}" (the default: every supervised '
            f'token of a step weighs the same), "{DIALOGUE}" (every dialogue weighs the '
            f'same) or "{MICRO_BATCH}" (XTuner\'s per-micro-batch mean)',
        )
    ]


# The chunked training loss (hooks.chunked_loss): on by default; False, or tokens per chunk.
CHUNKED_LOSS_KEY = "chunked_loss"
CHUNKED_LOSS_OPT_OUT = f"{CHUNKED_LOSS_KEY} = False"


def _chunked_loss_problem(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value > 0:
        return None
    return f"expected True, False or a number of tokens per chunk (> 0), got {value!r}"


def chunked_loss_setting(cfg: object) -> bool | int:
    """The config's ``chunked_loss`` (default True), checked.

    Raises:
        ValueError: a value that is no bool nor a positive int.
    """
    value = cfg.get(CHUNKED_LOSS_KEY, True) if hasattr(cfg, "get") else True
    problem = _chunked_loss_problem(value)
    if problem:
        raise ValueError(
            f"{CHUNKED_LOSS_KEY}: {problem}. Set it at the top level of the config, or delete "
            "it for the default (True)."
        )
    return value


@register_findings("loss")
def chunked_loss_findings(cfg) -> list[Finding]:
    """Start-up check: a ``chunked_loss`` that is no bool nor token count is refused."""
    problem = _chunked_loss_problem(config_dict(cfg).get(CHUNKED_LOSS_KEY, True))
    if problem is None:
        return []
    return [
        Finding(
            CHUNKED_LOSS_KEY,
            problem,
            f"set {CHUNKED_LOSS_KEY} = True (the default: the training loss in chunks of "
            "supervised tokens, no full logits), False (the model's own loss) or a number of "
            "tokens per chunk",
        )
    ]
