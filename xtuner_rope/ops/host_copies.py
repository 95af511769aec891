"""Host copies of device tensors: what lets a training forward plan without reading the device.

The data preprocessor's move (``compat.batch_host_copies``) remembers each copied tensor's host
tensor; :func:`host_copy` answers while the device tensor is alive and unchanged (same version).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["forget_host_copies", "host_copy", "remember_host_copy"]

# id(device tensor) -> (weak reference to it, its version, the host tensor, the host's version)
_COPIES: dict[int, tuple[weakref.ref, int, torch.Tensor, int]] = {}


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version  # inference tensors have no counter


def remember_host_copy(device_tensor: torch.Tensor, host: torch.Tensor) -> None:
    """Record that ``device_tensor`` holds the values of the CPU tensor ``host`` (after
    ``host.to(device)``); not for floating-point or inference tensors, nor a non-CPU ``host``.
    """
    if device_tensor is host or host.device.type != "cpu":
        return
    if host.is_floating_point() or host.is_complex():
        return
    versions = _version(device_tensor), _version(host)
    if None in versions:
        return
    key = id(device_tensor)

    def drop(_ref, key=key) -> None:
        _COPIES.pop(key, None)

    _COPIES[key] = (weakref.ref(device_tensor, drop), versions[0], host, versions[1])


def host_copy(x: torch.Tensor) -> torch.Tensor | None:
    """The values of ``x`` on the host without a device read: its remembered host copy, else
    ``x`` itself when it is on the CPU, else None (the caller reads the device)."""
    entry = _COPIES.get(id(x))
    if entry is not None:
        ref, version, host, host_version = entry
        if ref() is x and _version(x) == version and host._version == host_version:
            return host
    return x if x.device.type == "cpu" else None


def forget_host_copies() -> None:
    """Forget every remembered host copy (tests; the entries also go with their tensors)."""
    _COPIES.clear()
