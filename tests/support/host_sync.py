"""Catch, on any machine, what would make the host wait for a GPU: ``NoHostSync``.

A dispatch mode that sees every aten op and raises ``HostSyncError`` at the first one that would
synchronize on CUDA, for tensors on any device but the CPU:

- a device-to-host copy (``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``.numpy()``);
- a value read to the host (``.item()``, ``int(t)``, ``bool(t)``: ``aten._local_scalar_dense``,
  and every op tagged ``data_dependent_output``);
- an output whose shape depends on device values (``torch.unique``, ``nonzero``, boolean-mask
  indexing: ops tagged ``dynamic_output_shape``, except indexing with integer indices);
- a blocking host-to-device copy (CUDA's ``memcpy_and_sync``: what
  ``torch.cuda.set_sync_debug_mode("error")`` refuses too).

Without a GPU, run the code with its device tensors on the ``meta`` device: they have no values,
so a read that slipped past this mode would fail there too.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(AssertionError):
    """An op that makes the host wait for the device."""


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _tensors(args, kwargs):
    for value in [*args, *kwargs.values()]:
        if isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            yield value


def host_sync(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` would synchronize with the device, or None."""
    if func in (aten._to_copy.default, aten.copy_.default):
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            to = dst.device
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        else:
            src = args[0]
            to = torch.device(kwargs.get("device") or src.device)
            non_blocking = kwargs.get("non_blocking", False)
        if _on_device(src) and to.type == "cpu":
            return f"device-to-host copy ({func}) from {src.device}, shape {list(src.shape)}"
        if src.device.type == "cpu" and to.type != "cpu" and not non_blocking:
            return f"blocking host-to-device copy ({func}) to {to}, shape {list(src.shape)}"
        return None
    on_device = [t for t in _tensors(args, kwargs) if _on_device(t)]
    if not on_device:
        return None
    if torch.Tag.data_dependent_output in func.tags:
        return f"value read to the host ({func}) from {on_device[0].device}"
    if torch.Tag.dynamic_output_shape in func.tags:
        if func is aten.index.Tensor and not any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            return None  # integer indices: the output's shape is the index's
        return f"output shape read from the device ({func}) on {on_device[0].device}"
    return None


class NoHostSync(TorchDispatchMode):
    """Raise ``HostSyncError`` at the first op that would synchronize with the device.

    ``ops`` counts the ops seen (a check that the code under test ran inside the mode);
    ``host_copies`` lists the shape of every (non-blocking) host-to-device copy.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_copies: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func is aten._to_copy.default and args[0].device.type == "cpu":
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                self.host_copies.append(list(args[0].shape))
        why = host_sync(func, args, kwargs)
        if why is not None:
            raise HostSyncError(why)
        return func(*args, **kwargs)


@contextmanager
def sync_debug_error():
    """``torch.cuda.set_sync_debug_mode("error")`` inside, restored afterwards (CUDA only)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
