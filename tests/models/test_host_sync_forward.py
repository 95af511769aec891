"""A whole training step (forward, loss, backward) of a patched model reads nothing back from the
device when the batch carries its boundaries on the host (issue 48, "no host sync").

The batch is what the trainer hands the model: boundaries published on the host (as
``PackedBatchCheckHook`` publishes the collate function's ``cumulative_len``) and position ids
on the host (as collated) or on the device (as XTuner's data preprocessor moves them). The
rotaries use dynamic NTK with a threshold below the longest documents, so every piece runs: the
range check of the positions, their copy to the device, the per-document frequencies, the
attention plan, the packed attention and the backward through all of them.

On the CPU the "device" is ``meta`` (no values to read) under ``host_sync.NoHostSync``, which
fails at the first device-to-host copy, value read, data-dependent shape or blocking
host-to-device copy, and lists the non-blocking ones: the same number with 2 and 4 layers (one
per forward, shared by every layer). On CUDA the same step runs under
``torch.cuda.set_sync_debug_mode("error")`` (skipped without CUDA; run by
``tools/gpu/run_gpu.sh``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from gold import ROWS
from host_sync import NoHostSync, sync_debug_error

from xtuner_rope.demo.tiny import build_tiny_hf, build_tiny_internlm2
from xtuner_rope.models import channel
from xtuner_rope.models.dispatch import patch_model
from xtuner_rope.ops.document_plan import plan_documents
from xtuner_rope.ops.packing import cumulative_from_lengths, flat_cumulative

S = 32  # every row of ROWS fills 32 tokens; documents of 17 and 30 pass the threshold of 16
THRESHOLD = 16
SCALING = {
    "internlm2": dict(type="dynamic", factor=2.0),  # XTuner's class: the legacy key
    "llama": dict(rope_type="dynamic", factor=2.0),
}


def _model(family: str, layers: int, device: str) -> torch.nn.Module:
    """A patched tiny model of ``family`` (XTuner's InternLM2 class, or transformers' Llama)
    with dynamic NTK past ``THRESHOLD`` positions, on ``device``, in training mode."""
    build = build_tiny_internlm2 if family == "internlm2" else _hf_llama
    model = build(
        256,
        attn_implementation="sdpa",
        num_hidden_layers=layers,
        max_position_embeddings=THRESHOLD,
        rope_scaling=SCALING[family],
    )
    assert patch_model(model)[0] == layers
    return model.to(device).train()


def _hf_llama(vocab, **overrides):
    return build_tiny_hf("llama", vocab, **overrides)


def _batch(device: str, positions_on: str):
    """ids ``[2, S]`` on ``device``, position ids on the host or the device, and the flat host
    boundaries the collate function computed."""
    ids = torch.randint(3, 256, (2, S), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS])
    if positions_on == "device":
        positions = positions.to(device)
    return ids, positions, flat_cumulative([cumulative_from_lengths(row) for row in ROWS], S)


def _step(model, ids, positions, cu):
    """One training step's forward and backward with ``cu`` published on the host."""
    channel.publish(cu, max(max(row) for row in ROWS), rank=0)
    try:
        out = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)
        out.loss.backward()
    finally:
        channel.clear(rank=0)
    return out


def _host_copies(family: str, layers: int, positions_on: str) -> list[list[int]]:
    """The step on the meta device under ``NoHostSync``; the shapes of its host copies."""
    model = _model(family, layers, "meta")
    ids, positions, cu = _batch("meta", positions_on)
    with NoHostSync() as mode:
        _step(model, ids, positions, cu)
    assert mode.ops > 500  # the whole step ran inside the mode
    assert all(p.grad is not None for p in model.parameters())  # the backward ran too
    return mode.host_copies


@pytest.mark.parametrize("positions_on", ["host", "device"])
@pytest.mark.parametrize("family", ["internlm2", "llama"])
def test_training_step_reads_nothing_back(family, positions_on):
    copies = {layers: _host_copies(family, layers, positions_on) for layers in (2, 4)}
    # Host to device, once per forward whatever the depth: the position ids (when on the
    # host), the per-document frequency index [b, s], the plan's boundaries and buckets.
    assert copies[2] == copies[4]
    _, _, cu = _batch("meta", positions_on)
    buckets = [list(b.gather.shape) for b in plan_documents(cu, torch.device("meta")).buckets]
    # Copies of [b, s]: the position ids (from the host only), the frequency index, and the
    # length buckets of that shape (here the documents of 30 and 17 tokens padded to 32).
    expected = (positions_on == "host") + 1 + buckets.count([2, S])
    assert [shape for shape in copies[2] if shape == [2, S]] == [[2, S]] * expected


# ----- on CUDA: skipped without it, run by tools/gpu/run_gpu.sh -----


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("positions_on", ["host", "device"])
@pytest.mark.parametrize("family", ["internlm2", "llama"])
def test_cuda_training_step_without_a_host_sync(family, positions_on):
    """The same step under sync debug mode "error"; its loss and gradients equal the CPU's."""
    model = _model(family, 2, "cpu")
    on_cuda = copy.deepcopy(model).cuda()
    ids, positions, cu = _batch("cpu", positions_on)
    want = _step(model, ids, positions, cu)
    positions = positions.cuda() if positions_on == "device" else positions
    torch.cuda.synchronize()
    with sync_debug_error():
        got = _step(on_cuda, ids.cuda(), positions, cu)
    torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-4, atol=1e-4)
    for (name, p), ref in zip(on_cuda.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), ref.grad, rtol=1e-3, atol=1e-4, msg=name)
