"""A training forward reads no device data back, in every mode (issue 58, "no host sync").

The batch goes the way a run moves it: collated on the CPU, seen there by the hooks of
``before_train_iter`` (``PackedBatchCheckHook`` publishes the boundaries on the host; XTuner's
own ``VarlenAttnArgsToMessageHubHook`` publishes them on the device), then moved to the device
by the data preprocessor, which remembers each tensor's host copy
(``compat.patch_mmengine_host_copies``). On this CPU machine the move is a copy marked as device
data (``host_sync.DeviceReads``; the parameters are marked too), XTuner's hook publishes on the
``meta`` device (no values at all), and every read of device data by the package's code inside
``SupervisedFinetune.forward`` is listed: none in any forward after the first. Without the host
copies (:func:`forget_host_copies` after the move, what a device tensor from elsewhere is) the
same forwards read the device: the control that shows the count can fail.

Modes: packed rows with published boundaries (ours, XTuner's), packed rows with position resets
only, and XTuner's padded rows; InternLM2 (XTuner's class) and transformers' Llama, dynamic NTK
past 16 positions so the per-document frequencies run too; XTuner's LLaVA (tiny CLIP and
InternLM2, dynamic NTK past 32), packed by ``llava_collate_fn`` and padded by XTuner's collate;
XTuner's InternVL through the chunked loss, packed by ``internvl_collate_fn`` and padded.
Sequence parallel (two processes) is in test_sequence_parallel.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from host_sync import DeviceReads, preprocessor_move
from mmengine.config import ConfigDict
from multimodal_models import internvl_models, internvl_samples, llava_models, llava_samples
from test_host_sync_forward import SCALING, THRESHOLD
from transformers import AutoModelForCausalLM
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.engine.hooks import VarlenAttnArgsToMessageHubHook
from xtuner.model import SupervisedFinetune

from xtuner_rope import llava_collate_fn
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.data.collate_internvl import internvl_collate_fn
from xtuner_rope.demo.tiny import build_tiny
from xtuner_rope.demo.tiny_clip import image_tokens
from xtuner_rope.hooks.chunked_loss import enable_chunked_loss
from xtuner_rope.hooks.isolation import PackedBatchCheckHook
from xtuner_rope.models import channel
from xtuner_rope.models.chunked_loss import loss_only, patch_chunked_loss
from xtuner_rope.models.dispatch import patch_model
from xtuner_rope.ops.host_copies import forget_host_copies

ROWS = [[1, 5, 17, 9], [30, 2]]  # documents per row; 17 and 30 pass the threshold of 16
VOCAB = 256


def _items(rows) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    items = []
    for row in rows:
        ids = torch.randint(3, VOCAB, (sum(row),), generator=gen).tolist()
        cu = torch.tensor([0, *row]).cumsum(0).tolist()
        positions = torch.cat([torch.arange(n) for n in row]).tolist()
        items.append(
            {"input_ids": ids, "labels": ids, "cumulative_len": cu, "position_ids": positions}
        )
    return items


def _collate(mode: str) -> dict:
    """``data_batch`` as the dataloader hands it to the hooks (on the CPU)."""
    if mode == "xtuner_hook":  # XTuner's varlen collate: batch size 1
        return default_collate_fn(_items(ROWS[:1]), use_varlen_attn=True)
    if mode == "padded":  # XTuner's padded rows: one sample a row, attention_mask
        items = [{"input_ids": x["input_ids"], "labels": x["labels"]} for x in _items(ROWS)]
        items[1] = {k: v[:20] for k, v in items[1].items()}
        return default_collate_fn(items)
    batch = rope_collate_fn(_items(ROWS), max_length=sum(ROWS[0]))
    if mode == "resets":  # boundaries only in the position ids
        for key in ("cumulative_len", "max_seqlen"):
            batch["data"].pop(key)
    return batch


def _before_train_iter(mode: str, model, data_batch: dict, monkeypatch) -> None:
    """What the boundary hooks do, on the host batch."""
    if mode == "xtuner_hook":
        module = VarlenAttnArgsToMessageHubHook.__module__
        monkeypatch.setattr(f"{module}.get_device", lambda: "meta")  # a device without values
        VarlenAttnArgsToMessageHubHook().before_train_iter(None, 0, data_batch)
    else:
        hook, runner = PackedBatchCheckHook(), SimpleNamespace(model=model)
        hook.before_val(runner)
        hook.before_val_iter(runner, 0, data_batch)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Tiny checkpoints with dynamic NTK past ``THRESHOLD`` positions, per family."""
    root = tmp_path_factory.mktemp("device_reads")
    paths = {}
    for family in ("internlm2", "llama"):
        paths[family] = str(root / family)
        build_tiny(
            family,
            VOCAB,
            attn_implementation="sdpa",
            max_position_embeddings=THRESHOLD,
            rope_scaling=dict(SCALING[family]),
        ).save_pretrained(paths[family])
    return paths


def _sft(path: str) -> SupervisedFinetune:
    """XTuner's model as ``xtuner train`` builds it, patched as the plugin's hook patches it."""
    llm = ConfigDict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=path,
        attn_implementation="sdpa",
        trust_remote_code=True,
    )
    sft = SupervisedFinetune(llm=llm, use_activation_checkpointing=False)
    patch_model(sft)
    return sft.train()


def _reads_of_one_step(model, data_batch: dict, step, keep_host: bool = True) -> list:
    """The device reads of ``step(model, data)`` on the moved batch; what it returns (a loss)
    is backpropagated outside the count, before the hub and host copies are forgotten."""
    reads = DeviceReads()
    reads.on_device(list(model.parameters()), list(model.buffers()))
    data = preprocessor_move(data_batch["data"], reads, keep_host)
    try:
        with reads:
            loss = step(model, data)
        if loss is not None:
            loss.backward()
    finally:
        channel.clear()
        forget_host_copies()
    assert reads.calls > 300  # the whole forward ran inside the mode
    return reads.reads


def _forward_reads(
    mode: str, path: str, monkeypatch, keep_host: bool = True, chunked: bool = False
) -> list:
    """The reads of device data by the package in each of three training forwards
    (``chunked``: through the chunked training loss, as ``chunked_loss = True`` runs it)."""
    sft = _sft(path)
    if chunked:
        patch_chunked_loss(sft.llm)
    per_forward = []
    for _ in range(3):
        data_batch = _collate(mode)
        _before_train_iter(mode, sft, data_batch, monkeypatch)

        def step(model, data):
            with loss_only() if chunked else contextlib.nullcontext():
                return model(data, mode="loss")["loss"]

        per_forward.append(_reads_of_one_step(sft, data_batch, step, keep_host))
    return per_forward


CASES = [
    ("published", "internlm2"),
    ("published", "llama"),
    ("xtuner_hook", "internlm2"),
    ("resets", "internlm2"),
    ("resets", "llama"),
    ("padded", "llama"),
]


@pytest.mark.parametrize("mode,family", CASES)
def test_training_forward_reads_no_device_data(mode, family, checkpoints, monkeypatch):
    reads = _forward_reads(mode, checkpoints[family], monkeypatch)
    assert reads[1:] == [[], []], reads


@pytest.mark.parametrize("mode,family", [("published", "internlm2"), ("padded", "llama")])
def test_the_chunked_loss_reads_no_device_data(mode, family, checkpoints, monkeypatch):
    """The chunked loss finds the supervised positions in the labels' host copy."""
    reads = _forward_reads(mode, checkpoints[family], monkeypatch, chunked=True)
    assert reads[1:] == [[], []], reads


def test_the_chunked_loss_without_host_labels_reads_the_count(checkpoints, monkeypatch):
    """The control: labels nobody copied from the host are read back for the count."""
    reads = _forward_reads(
        "published", checkpoints["internlm2"], monkeypatch, keep_host=False, chunked=True
    )
    assert any("chunked_loss" in str(read) for read in reads[1]), reads


@pytest.mark.parametrize("mode,family", [("xtuner_hook", "internlm2"), ("resets", "llama")])
def test_without_host_copies_the_forward_reads_the_device(mode, family, checkpoints, monkeypatch):
    """The control: device tensors nobody copied from the host are read back (once per
    forward), or cannot be read at all (XTuner's boundaries on ``meta``)."""
    if mode == "xtuner_hook":
        with pytest.raises(NotImplementedError, match="meta"):
            _forward_reads(mode, checkpoints[family], monkeypatch, keep_host=False)
        return
    reads = _forward_reads(mode, checkpoints[family], monkeypatch, keep_host=False)
    assert all(reads) and len(reads[1]) < 10, reads


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model, _ = llava_models(
        tmp_path_factory.mktemp("llava_reads"),
        rope_scaling={"type": "dynamic", "factor": 2.0},
        max_position_embeddings=32,
    )
    return model


def _llava_batch(packed: bool, seed: int) -> dict:
    items = llava_samples(6, seed=seed)
    if packed:
        return llava_collate_fn(items, max_length=200, image_tokens=image_tokens())
    return default_collate_fn(items)


@pytest.mark.parametrize("chunked", [False, True], ids=["own_loss", "chunked_loss"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_llava_training_forward_reads_no_device_data(llava, packed, chunked):
    """XTuner's LLaVA forward: the expansion's check, the expanded boundaries and positions,
    the plan and the per-document frequencies read the host batch; XTuner's own reads (its
    expansion indexes with device masks) are XTuner's. The chunked loss finds the supervised
    positions in the expanded labels' host copy (``models.llava.expanded_labels``)."""
    per_forward, logits = [], []
    llava.train()
    if chunked:
        patch_chunked_loss(llava.llm)
    kept = llava.llm.register_forward_hook(lambda m, a, out: logits.append(out.logits))
    try:
        for seed in range(3):
            data_batch = _llava_batch(packed, seed)
            _before_train_iter("published", llava, data_batch, None)

            def step(model, data):
                with loss_only() if chunked else contextlib.nullcontext():
                    model(data, mode="loss")

            per_forward.append(_reads_of_one_step(llava, data_batch, step))
    finally:
        kept.remove()
        llava.eval()
    assert per_forward[1:] == [[], []], per_forward
    assert all((x is None) == chunked for x in logits) and len(logits) == 3


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    """XTuner's InternVL (tiny InternLM2 inside) with the chunked loss, as a run switches it on."""
    model, _, tokens = internvl_models(tmp_path_factory.mktemp("internvl_reads"))
    assert "chunked loss" in enable_chunked_loss(SimpleNamespace(cfg={}, model=model))
    return model, tokens


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_internvl_chunked_loss_reads_no_device_data(internvl, packed):
    """InternVL's training forward through the chunked loss: the LLM is given the batch's labels
    (their host copy), the plan reads the host batch."""
    model, (context, per_tile, side) = internvl
    per_forward = []
    model.train()
    try:
        for seed in range(3):
            items = internvl_samples(6, seed, context, per_tile, side)
            data_batch = (
                internvl_collate_fn(items, max_length=128) if packed else default_collate_fn(items)
            )
            _before_train_iter("published", model, data_batch, None)
            per_forward.append(
                _reads_of_one_step(
                    model, data_batch, lambda m, d: m(d, mode="loss")["loss"].backward()
                )
            )
    finally:
        model.eval()
    assert per_forward[1:] == [[], []], per_forward
