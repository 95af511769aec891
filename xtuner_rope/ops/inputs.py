"""User input -> integer tensors, with errors that name the field and the bad element.

``torch.as_tensor``'s messages name neither the sample nor the field; the public entry points
convert through :func:`to_int_tensor` instead. Torch only.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Integral

import torch

__all__ = ["show", "to_int_tensor"]

INT64_RANGE = (-(1 << 63), 1 << 63)


def show(value: object) -> str:
    """Short description of an offending value for an error message."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _conversion_error(value: object, where: str, fix: str) -> Exception:
    """Why ``torch.as_tensor(value)`` failed, as an error naming the first bad element."""
    items = list(value) if isinstance(value, (list, tuple)) else []
    for k, v in enumerate(items):
        if isinstance(v, Integral) and not isinstance(v, bool):
            if not INT64_RANGE[0] <= int(v) < INT64_RANGE[1]:
                return ValueError(
                    f"{where}: expected ints in the int64 range, got {v} at index {k}. {fix}"
                )
        elif isinstance(v, (list, tuple)):
            return ValueError(
                f"{where}: expected a flat sequence of ints, got a nested "
                f"{type(v).__name__} at index {k}. {fix}"
            )
        elif not isinstance(v, (float, complex, bool)):
            return TypeError(f"{where}: expected ints, got {show(v)} at index {k}. {fix}")
    return TypeError(
        f"{where}: expected a list, tuple, array or tensor of ints, got {show(value)}. {fix}"
    )


def to_int_tensor(value: object, where: str, fix: str) -> torch.Tensor:
    """``value`` (list, tuple, array or tensor of ints) as an integer tensor, shape kept (the tensor
    itself when it is one; empty input gives ``long``); ``where`` (who, which field) and ``fix``
    (what to do) go into the message.

    Raises:
        TypeError: None, a string, a non-int element, or a float/complex/bool dtype.
        ValueError: a ragged or nested sequence, an int beyond the int64 range.
    """
    if isinstance(value, torch.Tensor):
        tensor = value
    elif value is None or isinstance(value, (str, bytes, Mapping)):
        raise TypeError(f"{where}: expected a list or tensor of ints, got {show(value)}. {fix}")
    else:
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise _conversion_error(value, where, fix) from None
    if tensor.numel() == 0:
        return tensor.long()
    dtype = tensor.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"{where}: expected integer values, got dtype {dtype}. {fix}")
    return tensor
