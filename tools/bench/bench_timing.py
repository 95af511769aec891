"""Timing shared by the benches: CUDA events over back-to-back calls on CUDA, a clock elsewhere.

One call bracketed by `torch.cuda.synchronize()` and `time.perf_counter()` times the host's
launch path (Python, argument checks, the launch itself) as much as the kernel: for a kernel of
tens of microseconds that is most of the figure. Many calls back to back between two CUDA
events let the host queue work ahead while the device runs, so the events measure the device's
time per call (or the host's, where the host is the slower: then the kernel is launch-bound and
the figure says so honestly).
"""

import time

import torch


def seconds_per_call(fn, calls=1, device="cpu", clock=time.perf_counter):
    """Seconds per call of ``fn()`` run ``calls`` times back to back.

    Args:
        fn: The work of one call (no argument; its result is dropped).
        calls: Calls timed together (on CUDA, enough to cover the launch path: 10-50).
        device: Where ``fn`` runs; on CUDA, events on the current stream time the calls.
        clock: The host clock elsewhere (``time.process_time`` for this process's CPU time).

    Returns:
        float: The mean seconds of one call.
    """
    if torch.device(device).type != "cuda":
        start = clock()
        for _ in range(calls):
            fn()
        return (clock() - start) / calls
    torch.cuda.synchronize(device)  # nothing queued before the first event
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / calls
