"""``compat.batch_host_copies``: what moves the batch to the device remembers its host copy."""

import torch
from mmengine.model import BaseDataPreprocessor
from xtuner.engine.hooks import VarlenAttnArgsToMessageHubHook

import xtuner_rope  # noqa: F401 - applies the patches
from xtuner_rope.models import channel
from xtuner_rope.ops.host_copies import forget_host_copies, host_copy


def test_data_preprocessor_move_remembers_each_host_tensor():
    preprocessor = BaseDataPreprocessor()
    preprocessor._device = torch.device("meta")  # a move that copies, values left behind
    ids, positions = torch.arange(6).view(1, 6), torch.tensor([[0, 1, 2, 0, 1, 2]])
    data = preprocessor({"data": {"input_ids": ids, "position_ids": positions}}, True)["data"]
    assert data["position_ids"].device.type == "meta"
    assert host_copy(data["position_ids"]) is positions
    assert host_copy(data["input_ids"]) is ids
    forget_host_copies()


def test_xtuner_varlen_hook_remembers_the_published_boundaries(monkeypatch):
    module = VarlenAttnArgsToMessageHubHook.__module__
    monkeypatch.setattr(f"{module}.get_device", lambda: "meta")
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    batch = {"data": {"cumulative_len": [cu], "max_seqlen": 4}}
    VarlenAttnArgsToMessageHubHook().before_train_iter(None, 0, batch)
    try:
        published = channel.read()[0]
        assert published.device.type == "meta" and host_copy(published) is cu
    finally:
        channel.clear()
        forget_host_copies()
