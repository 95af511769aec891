"""DeepSpeed patches on CPU: the allgather grad mode (ZeRO-1/2) and the ZeRO-3 parameter gather."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types

import torch

from .guard import at_least, installed_version


def deepspeed_flat_buffer_requires_grad() -> bool:
    """True if the installed DeepSpeed predates 0.19.0 (which detached ZeRO-1/2's flat buffer)."""
    return installed_version("deepspeed") is not None and not at_least("deepspeed", "0.19.0")


def patch_deepspeed_cpu_allgather_grad_mode() -> bool:
    """Let DeepSpeed < 0.19 ZeRO-1/2 take its optimizer step over gloo on a CPU-only machine.

    deepspeed 0.17.6 - 0.18.9 keep ZeRO-1/2's flat buffer attached to autograd; torch 2.15's gloo
    all-gather writes through ``split`` views of it ("Output 0 of Split is a view and is being
    modified inplace"). The gather is a weight update: it runs under ``torch.no_grad()``. False
    where DeepSpeed gathers another way.
    """
    import deepspeed.runtime.utils as ds_utils

    gather = getattr(ds_utils, "all_gather_into_tensor_dp_groups", None)
    if gather is None:  # an older DeepSpeed gathers another way
        return False

    @functools.wraps(gather)
    def gather_without_grad(*args, **kwargs):
        with torch.no_grad():
            return gather(*args, **kwargs)

    ds_utils.all_gather_into_tensor_dp_groups = gather_without_grad
    return True


class _GatherHandleRecorder:
    """``deepspeed.comm`` as ``partition_parameters`` sees it, recording async gather handles.

    Every attribute is DeepSpeed's own; the two all-gathers also record the handle they return
    in this thread's open recording (:meth:`every_gather_waited`), if any.
    """

    def __init__(self, comm: types.ModuleType):
        self._comm = comm
        self._local = threading.local()

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def _record(self, handle):
        pending = getattr(self._local, "pending", None)
        if pending is not None and handle is not None:
            pending.append(handle)
        return handle

    def all_gather_into_tensor(self, *args, **kwargs):
        return self._record(self._comm.all_gather_into_tensor(*args, **kwargs))

    def all_gather(self, *args, **kwargs):
        return self._record(self._comm.all_gather(*args, **kwargs))

    @contextlib.contextmanager
    def every_gather_waited(self):
        """Record the gathers started inside the block; on leaving it, wait for each."""
        outer = getattr(self._local, "pending", None)
        self._local.pending = []
        try:
            yield
            for handle in self._local.pending:
                handle.wait()
        finally:
            self._local.pending = outer


def _waits_only_for_last_gather(method) -> bool:
    """True if DeepSpeed's coalesced gather still waits on its last handle only (no PR #8539)."""
    try:
        return "launch_handles[-1].wait()" in inspect.getsource(method)
    except (OSError, TypeError):  # no source shipped: waiting twice is harmless, so patch
        return True


def patch_deepspeed_zero3_cpu_gather() -> bool:
    """Make ZeRO-3's coalesced parameter gather wait for every all-gather on the CPU accelerator.

    deepspeed 0.19.6 ``Init._allgather_params_coalesced`` waits on the last handle only; gloo runs
    the gathers out of order, so a rank reads parameters not yet written (``tools/repro/
    zero3_gather.py``; fixed by DeepSpeed PR #8539, in releases mmengine 0.10.6 cannot import). The
    module's ``dist`` records the handles, and the method returns once each is waited. False off
    the CPU accelerator or with the upstream fix.
    """
    import deepspeed.runtime.zero.partition_parameters as zero3
    from deepspeed.accelerator import get_accelerator

    coalesced = zero3.Init._allgather_params_coalesced
    if get_accelerator().device_name() != "cpu" or not _waits_only_for_last_gather(coalesced):
        return False
    recorder = _GatherHandleRecorder(zero3.dist)

    @functools.wraps(coalesced)
    def gather_waiting_for_all(self, *args, **kwargs):
        with recorder.every_gather_waited():
            return coalesced(self, *args, **kwargs)

    zero3.dist = recorder
    zero3.Init._allgather_params_coalesced = gather_waiting_for_all
    return True
