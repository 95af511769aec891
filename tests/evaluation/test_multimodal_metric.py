"""``TokenLossMetric`` on XTuner's LLaVA and InternVL models, through their real ``val_step``.

Held-out image and text samples, collated as a run collates them (``llava_collate_fn`` /
``internvl_collate_fn`` packing several samples to a row, or XTuner's ``default_collate_fn``
one to a row), go through the patched model's ``val_step`` as MMEngine's ``ValLoop`` runs it
(``PackedBatchCheckHook`` publishes the boundaries, ``val_step``, ``metric.process``, reset).
Reference: each sample alone through an unmodified copy of the model, its own loss
(``mode='loss'``: the LLM's mean cross-entropy over the sample's text labels) times its
supervised tokens, summed and divided by the tokens. Two data-parallel ranks are played with
MMEngine's own ``DefaultSampler`` (one rank's last batch holds a repeat of sample 0) and
``collect_results``' order. Negative control: the same packed rows through the unpatched copy
(boundaries published, attention not isolated) move the loss beyond the 1e-5 tolerance.
"""

import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from mmengine.dataset import DefaultSampler
from multimodal_models import internvl_models, internvl_samples, llava_models, llava_samples

from xtuner_rope import internvl_collate_fn, llava_collate_fn
from xtuner_rope.demo.tiny_clip import image_tokens
from xtuner_rope.evaluation.metric import TokenLossMetric
from xtuner_rope.hooks import PackedBatchCheckHook

N = 7  # samples: odd, so 2 ranks' sampler repeats one


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model, reference = llava_models(tmp_path_factory.mktemp("llava_metric"))
    return model, reference, llava_samples(N, seed=5)


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    model, reference, (context, per_tile, side) = internvl_models(
        tmp_path_factory.mktemp("internvl_metric")
    )
    return model, reference, internvl_samples(N, 5, context, per_tile, side)


def _rank_indices(world: int) -> list[list[int]]:
    """Each rank's indices from MMEngine's ``DefaultSampler(shuffle=False)``."""
    ranks = []
    for rank in range(world):
        with mock.patch("mmengine.dataset.sampler.get_dist_info", return_value=(rank, world)):
            ranks.append(list(DefaultSampler(list(range(N)), shuffle=False)))
    return ranks


def _collect(parts: list[list], size: int) -> list:
    """MMEngine's ``collect_results`` order: the ranks' results interleaved, cut to ``size``."""
    return [r for column in zip(*parts) for r in column][:size]


def _evaluate(model, items, collate, world: int = 1, batch: int = 2) -> dict:
    """The metric over ``items`` as ``ValLoop`` computes it on ``world`` ranks."""
    hook, runner = PackedBatchCheckHook(), SimpleNamespace(model=model)
    hook.before_val(runner)
    metric, parts = TokenLossMetric(), []
    for indices in _rank_indices(world):
        metric.results = []
        for start in range(0, len(indices), batch):
            data_batch = collate([items[i] for i in indices[start : start + batch]])
            hook.before_val_iter(runner, 0, data_batch)
            try:
                with torch.no_grad():
                    outputs = model.val_step(data_batch)
                metric.process(data_batch, outputs)
            finally:
                hook.after_val_iter(runner, 0, data_batch)
        parts.append(metric.results)
    return metric.compute_metrics(_collect(parts, N))


def _alone(reference, items, collate) -> dict:
    """Each sample alone through the unmodified model: its own loss x its supervised tokens."""
    nll, tokens, dialogues = [], 0, 0
    for item in items:
        n = sum(label != -100 for label in item["labels"][1:])
        if n == 0:
            continue
        with torch.no_grad():
            loss = reference(collate([item])["data"], mode="loss")["loss"]
        nll.append(float(loss.double()) * n)
        tokens, dialogues = tokens + n, dialogues + 1
    return {"loss": math.fsum(nll) / tokens, "tokens": tokens, "dialogues": dialogues}


def _assert_equal(got: dict, plain: dict) -> None:
    assert got["heldout_tokens"] == plain["tokens"], (got, plain)
    assert got["heldout_dialogues"] == plain["dialogues"], (got, plain)
    assert abs(got["heldout_loss"] - plain["loss"]) <= 1e-5 * plain["loss"], (got, plain)


def _llava_collate(items, pack=True):
    return llava_collate_fn(items, max_length=400, image_tokens=image_tokens(), pack=pack)


def _xtuner_collate(items):
    from xtuner.dataset.collate_fns import default_collate_fn

    return default_collate_fn(items)


@pytest.mark.parametrize("world", [1, 2], ids=["1-rank", "2-ranks"])
def test_llava_packed_heldout_loss_equals_each_sample_alone(llava, world):
    model, reference, items = llava
    got = _evaluate(model, items, _llava_collate, world=world, batch=3)
    plain = _alone(reference, items, _xtuner_collate)
    _assert_equal(got, plain)
    print(f"LLaVA packed, {world} rank(s): {got['heldout_loss']!r} vs alone {plain['loss']!r}")


def test_llava_padded_rows_and_the_unpatched_packed_rows(llava):
    model, reference, items = llava
    plain = _alone(reference, items, _xtuner_collate)
    _assert_equal(_evaluate(model, items, _xtuner_collate, world=2), plain)  # XTuner's collate
    # Negative control: packed rows through the unpatched copy leak across samples.
    leaked = _evaluate_unisolated(reference, items, _llava_collate)
    assert abs(leaked["heldout_loss"] - plain["loss"]) > 1e-5 * plain["loss"], (leaked, plain)
    print(f"LLaVA packed, unpatched: {leaked['heldout_loss']!r} vs alone {plain['loss']!r}")


def _evaluate_unisolated(reference, items, collate) -> dict:
    """The packed rows' boundaries published for the metric, the attention left unpatched."""
    from xtuner_rope.models import channel
    from xtuner_rope.ops.packing import flat_cumulative

    metric = TokenLossMetric()
    PackedBatchCheckHook().before_val(SimpleNamespace(model=reference))  # LLaVA expansion wrap
    for start in range(0, N, 3):
        data_batch = collate(items[start : start + 3])
        data = data_batch["data"]
        b, s = data["input_ids"].shape
        channel.publish(flat_cumulative(list(data.pop("cumulative_len")), s), data["max_seqlen"])
        for key in ("max_seqlen", "num_unsupervised"):
            data.pop(key)
        try:
            with torch.no_grad():
                metric.process(data_batch, reference.val_step(data_batch))
        finally:
            channel.clear()
    return metric.compute_metrics(metric.results)


def _internvl_collate(items):
    return internvl_collate_fn(items, max_length=512)


@pytest.mark.parametrize("world", [1, 2], ids=["1-rank", "2-ranks"])
def test_internvl_packed_heldout_loss_equals_each_sample_alone(internvl, world):
    model, reference, items = internvl
    got = _evaluate(model, items, _internvl_collate, world=world, batch=3)
    plain = _alone(reference, items, lambda x: internvl_collate_fn(x, max_length=512, pack=False))
    _assert_equal(got, plain)
    if world == 2:
        leaked = _evaluate_unisolated(reference, items, _internvl_collate)
        assert abs(leaked["heldout_loss"] - plain["loss"]) > 1e-5 * plain["loss"], leaked
        print(f"InternVL packed, unpatched: {leaked['heldout_loss']!r}")
    print(f"InternVL packed, {world} rank(s): {got['heldout_loss']!r} vs alone {plain['loss']!r}")
