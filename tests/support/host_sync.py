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

Code that needs values (XTuner's LLaVA expansion, sequence parallel's collectives) runs on real
CPU tensors under ``DeviceReads`` instead: the test marks which tensors stand for device ones,
and every read of their data by the package's code is listed.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import xtuner_rope
from xtuner_rope.ops.host_copies import forget_host_copies, remember_host_copy

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


# ----- On the CPU, with values: which reads of device data would the package make? -----

_PACKAGE = str(Path(xtuner_rope.__file__).resolve().parent)
_TORCH = str(Path(torch.__file__).resolve().parent)
_HERE = str(Path(__file__).resolve())
# Tensor methods that hand device values to the host: on CUDA each waits for the GPU.
_VALUE_READS = {"item", "tolist", "numpy", "__int__", "__bool__", "__float__", "__index__"}
# Factories: given a ``torch.device`` (``device=x.device``, not the string "cpu"), a device tensor.
_FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "randn", "rand"}
# Ops whose output shape depends on device values (CUDA syncs to size the output).
_SHAPE_READS = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"}


def _flat_tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat_tensors(v)


def _to_host(func, args, kwargs) -> bool:
    """``.cpu()`` / ``.to("cpu")`` (a device-to-host copy on CUDA).

    On the CPU, ``.to(x.device)`` (a ``torch.device``: the device tensors' own device on CUDA)
    cannot be told from a move to the host; the string ``"cpu"`` is what code writes for one.
    """
    name = getattr(func, "__name__", "")
    if name == "cpu":
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return name == "to" and isinstance(target, str) and torch.device(target).type == "cpu"


class DeviceReads(TorchFunctionMode):
    """Count the reads of device-side data by the package's own code, on a CPU machine.

    On the CPU every tensor is a host tensor, so the test says which ones stand for device
    tensors (:meth:`on_device`: the batch as the data preprocessor hands it to the model, the
    model's parameters); every tensor computed from one of them counts as device-side too. A
    read is a device-side tensor's value handed to Python (``.item()``, ``.tolist()``,
    ``.numpy()``, ``int()``, ``bool()``, ``float()``), copied to the host (``.cpu()``,
    ``.to('cpu')``, which here return an unmarked copy, as on CUDA) or sizing an output
    (``nonzero``, ``unique``, boolean-mask indexing). Tensors made by a factory given a
    ``torch.device`` (``torch.zeros(..., device=x.device)``) count as device tensors too; code
    that means the host writes the string ``"cpu"`` or no device. Not seen: a host tensor moved
    with ``.to(x.device)`` (on the CPU the same tensor; ``.to(x.device)`` of a host ``x`` is not a
    move either), which the meta-device test and the CUDA test cover. A read is counted when
    the innermost frame outside torch is the package's (``xtuner_rope``): XTuner's and
    transformers' own reads are theirs. ``reads`` lists ``"file:line what"`` of each.
    """

    def __init__(self) -> None:
        super().__init__()
        self._marked: dict[int, weakref.ref] = {}
        self.reads: list[str] = []
        self.calls = 0

    def on_device(self, *values) -> None:
        """Treat the tensors of ``values`` (nested lists, tuples, dicts) as device tensors."""
        for t in _flat_tensors(values):
            self._marked[id(t)] = weakref.ref(t)

    def is_device(self, t: torch.Tensor) -> bool:
        ref = self._marked.get(id(t))
        return ref is not None and ref() is t

    def _where(self) -> str | None:
        """``file:line`` of the innermost frame outside torch if it is the package's."""
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if not (path.startswith(_TORCH) or path == _HERE):
                if path.startswith(_PACKAGE):
                    return f"{path[len(_PACKAGE) - len('xtuner_rope') :]}:{frame.f_lineno}"
                return None
            frame = frame.f_back
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls += 1
        name = getattr(func, "__name__", "")
        device_in = [t for t in _flat_tensors((args, kwargs)) if self.is_device(t)]
        out = func(*args, **kwargs)
        if name in _FACTORIES and isinstance(kwargs.get("device"), torch.device):
            self.on_device(out)  # e.g. XTuner's expansion: torch.zeros(..., device=x.device)
        if not device_in:
            return out
        read = name in _VALUE_READS or name in _SHAPE_READS or _to_host(func, args, kwargs)
        if name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _flat_tensors(args[1:])
        ):
            read = True  # boolean-mask indexing: the output's length is the mask's count
        if read:
            where = self._where()
            if where is not None:
                self.reads.append(f"{where} {name}")
        if _to_host(func, args, kwargs) and isinstance(out, torch.Tensor):
            return out.clone()  # the host copy: reading it later costs nothing
        if name not in _VALUE_READS:
            self.on_device(out)
        return out


def preprocessor_move(data: dict, reads: DeviceReads, keep_host: bool = True) -> dict:
    """The data preprocessor's move, on a CPU machine: each tensor of ``data`` copied (its
    "device" copy, marked as device data in ``reads``) and its host tensor remembered, as
    ``compat.patch_mmengine_host_copies`` remembers it on a GPU. ``keep_host=False`` forgets
    every host copy afterwards (device tensors that came from elsewhere)."""
    moved = {}
    for key, value in data.items():
        moved[key] = value.clone() if torch.is_tensor(value) else value
        if torch.is_tensor(value):
            remember_host_copy(moved[key], value)
    reads.on_device(moved)
    if not keep_host:
        forget_host_copies()
    return moved
