"""Host copies of device tensors: what lets a training forward plan without reading the device.

The batch reaches the model on the device, but it was collated on the CPU: the data
preprocessor's move (``compat.patch_mmengine_host_copies``) remembers, for each tensor it
copies to the device, the host tensor it came from. Code that must know a batch tensor's values
on the host (where the documents are, the positions' range, each row's length) asks
:func:`host_copy` first and reads the host tensor: no device-to-host copy, no host sync, on
every layer of every forward. A device tensor without a known host copy is read back as
before (once per forward, cached by the caller).

A host copy is valid while its device tensor is alive and unchanged (same version counter):
an in-place edit of the device tensor (or of the host one) forgets it.
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
    """Record that ``device_tensor`` holds the values of the CPU tensor ``host``.

    Call where a host tensor was copied to the device (``host.to(device)``); nothing is
    recorded for the same tensor (a move to the CPU itself), a non-CPU ``host``, floating-point
    tensors (pixel values, embeddings: the forward never needs them on the host, and keeping
    them would hold host memory), or inference tensors (no version counter to tell a later
    edit).
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
