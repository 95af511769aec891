"""``ops.host_copies``: a device tensor's host copy is handed back while both are unchanged."""

import gc

import torch

from xtuner_rope.ops.host_copies import forget_host_copies, host_copy, remember_host_copy


def test_host_copy_is_handed_back_while_valid():
    host = torch.arange(6).view(2, 3)
    device = host.to("meta")  # a copy with no values: only the host copy can be read
    assert host_copy(device) is None
    remember_host_copy(device, host)
    assert host_copy(device) is host
    assert host_copy(host) is host  # a CPU tensor is its own host copy
    device.add_(1)  # an in-place edit of the device tensor: the copy is stale
    assert host_copy(device) is None
    forget_host_copies()


def test_edited_host_dropped_device_and_floats_are_not_kept():
    host = torch.arange(4)
    device = host.to("meta")
    remember_host_copy(device, host)
    host[0] = 5  # the host tensor changed after the move
    assert host_copy(device) is None
    fresh = torch.arange(4)
    device = fresh.to("meta")
    remember_host_copy(device, fresh)
    assert host_copy(device) is fresh
    del device
    gc.collect()
    from xtuner_rope.ops import host_copies

    assert not host_copies._COPIES  # gone with its device tensor
    pixels = torch.randn(2, 3)
    moved = pixels.to("meta")
    remember_host_copy(moved, pixels)
    assert host_copy(moved) is None  # floating point: never needed on the host, not kept
