"""LLaVA samples packed at collate time: each sample's LLM logits equal the sample alone.

Model-level, through XTuner's real ``LLaVAModel`` (tiny CLIP + tiny InternLM2 with hub-style
remote code): ``llava_collate_fn`` packs text-only and image samples (1..~40 tokens, 16 patch
tokens per image) into rows, ``PackedBatchCheckHook`` checks and publishes the boundaries as in
a run, ``LLaVAModel.forward`` expands the images, and the plugin expands the boundaries and
restarts the positions per sample. Reference: each sample alone, collated by XTuner's own
``default_collate_fn``, through an unpatched copy of the same model. Negative control: the
packed rows through the unpatched model leak across samples.
"""

from types import SimpleNamespace

import pytest
import stock_configs as sc
import torch
from multimodal_models import llava_models as _llava_models
from multimodal_models import llava_samples as _samples
from xtuner.dataset.collate_fns import default_collate_fn

from xtuner_rope import llava_collate_fn
from xtuner_rope.batch.image_packing import expanded_length
from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX
from xtuner_rope.capture.llava import isolation_figures
from xtuner_rope.demo.runlog import check_run
from xtuner_rope.demo.tiny_clip import image_tokens
from xtuner_rope.hooks import PackedBatchCheckHook
from xtuner_rope.models.rope_documents import reset_upstream_rotaries, set_per_document_rope
from xtuner_rope.ops.packing import plan_packs

P = image_tokens()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _llava_models(tmp_path_factory.mktemp("llava_pack"))


def _alone(reference, item) -> torch.Tensor:
    data = default_collate_fn([item])["data"]
    reset_upstream_rotaries(reference)  # dynamic NTK is stateful upstream: start as loaded
    with torch.no_grad():
        return reference(data, mode="tensor").logits[0]


def _packed_logits(model, batch: dict, isolate: bool) -> torch.Tensor:
    data = dict(batch)
    if isolate:  # as in a run: the hook checks the batch and publishes its boundaries
        hook, runner = PackedBatchCheckHook(), SimpleNamespace(model=model)
        hook.before_val(runner)
        hook.before_val_iter(runner, 0, {"data": data, "data_samples": None})
    else:
        for key in ("cumulative_len", "max_seqlen", "num_unsupervised"):
            data.pop(key, None)
    try:
        with torch.no_grad():
            return model(data, mode="tensor").logits
    finally:
        PackedBatchCheckHook._reset()


def _per_sample_diffs(model, reference, items, max_length, isolate=True):
    batch = llava_collate_fn(items, max_length=max_length, image_tokens=P, return_hf_format=True)
    lengths = [expanded_length(torch.tensor(x["input_ids"]), P) for x in items]
    plan = plan_packs(lengths, max_length)
    assert batch["input_ids"].shape[0] == len(plan)
    assert len(batch["pixel_values"]) == sum(
        max(1, sum(IMAGE_TOKEN_INDEX in items[i]["input_ids"] for i in row)) for row in plan
    )
    logits = _packed_logits(model if isolate else reference, batch, isolate)
    diffs = []
    for r, row in enumerate(plan):
        col = 0
        for i in row:
            alone = _alone(reference, items[i])
            assert alone.shape[0] == lengths[i]
            diffs.append(float((logits[r, col : col + lengths[i]] - alone).abs().max()))
            col += lengths[i]
    return plan, diffs


@pytest.mark.parametrize(
    "picked,max_length,rows",
    [
        (slice(None), 400, 1),  # image and text-only samples, one row
        (slice(None), 100, 3),  # several rows, each with an image
        (slice(1, None, 2), 400, 1),  # text-only samples: the row takes one (ignored) image
    ],
)
def test_packed_llava_samples_equal_each_alone(models, picked, max_length, rows):
    model, reference = models
    items = _samples(8, seed=1)[picked]
    plan, diffs = _per_sample_diffs(model, reference, items, max_length)
    assert len(plan) == rows and any(len(row) > 2 for row in plan), plan
    assert max(diffs) <= 1e-5, diffs
    # Negative control: the same packed rows through the unpatched model leak.
    _, leaked = _per_sample_diffs(model, reference, items, max_length, isolate=False)
    assert max(leaked) > 1e-2, leaked
    print(f"{len(plan)} rows: max |packed - alone| {max(diffs):.3g}, unpatched {max(leaked):.3g}")


# Dynamic NTK (InternLM2's remote-code class, factor 2) with a threshold of 32 positions: the
# expanded samples (1..54 tokens, an image adding 15) fall on both sides of it.
DYNAMIC_THRESHOLD = 32


@pytest.fixture(scope="module")
def dynamic_models(tmp_path_factory):
    return _llava_models(
        tmp_path_factory.mktemp("llava_dynamic"),
        rope_scaling={"type": "dynamic", "factor": 2.0},
        max_position_embeddings=DYNAMIC_THRESHOLD,
    )


def test_packed_llava_samples_get_their_own_dynamic_ntk_frequencies(dynamic_models):
    """Issue 31 on LLaVA rows: each sample's length is counted after the image expansion, so a
    sample gets the frequencies it gets alone whether it is below or above the threshold."""
    model, reference = dynamic_models
    items = _samples(8, seed=1)
    lengths = [expanded_length(torch.tensor(x["input_ids"]), P) for x in items]
    assert min(lengths) <= DYNAMIC_THRESHOLD < max(lengths), lengths  # both sides
    plan, diffs = _per_sample_diffs(model, reference, items, 400)
    assert len(plan) == 1 and sum(lengths) > DYNAMIC_THRESHOLD, plan
    assert max(diffs) <= 1e-5, diffs
    # Negative control: one set of frequencies for the whole row (upstream's choice) moves the
    # samples that are short alone.
    assert set_per_document_rope(model, False) > 0
    try:
        _, shared = _per_sample_diffs(model, reference, items, 400)
    finally:
        set_per_document_rope(model, True)
    short = [d for d, n in zip(shared, lengths) if n <= DYNAMIC_THRESHOLD]
    assert max(short) > 1e-4, shared
    # The capture hooks' and check's judge (``isolation_figures``) on the same row, in the
    # hooks' order: the unpatched packed row first (upstream's rotary grows for good), then
    # each sample alone, which must start from the loaded frequencies again.
    saved = _llm_inputs(model, items)
    keys = ("inputs_embeds", "position_ids", "attention_mask")
    with torch.no_grad():
        saved["unpatched_logits"] = reference.llm(**{k: saved[k] for k in keys}).logits
    figures = isolation_figures(reference.llm, saved)
    assert figures["samples"] == len(items) and figures["max_abs_diff"] <= 1e-5, figures
    print(
        f"dynamic NTK LLaVA row of {sum(lengths)} tokens, samples {lengths}: max |packed - alone| "
        f"{max(diffs):.3g} (isolation_figures {figures['max_abs_diff']:.3g}); per-document off "
        f"{max(short):.3g}"
    )


PADDED_COLLATES = {
    "default_collate_fn": lambda items: default_collate_fn(items, return_hf_format=True),
    "llava_collate_fn(pack=False)": lambda items: llava_collate_fn(
        items, max_length=400, image_tokens=P, pack=False, return_hf_format=True
    ),
}


@pytest.mark.parametrize("collate", list(PADDED_COLLATES))
def test_padded_llava_rows_get_their_own_dynamic_ntk_frequencies(dynamic_models, collate):
    """Issue 38 on LLaVA's padded rows (the stock ``default_collate_fn``, batch size > 1, and
    ``llava_collate_fn(pack=False)``): each sample, expanded and right-padded to the batch's
    longest, gets the frequencies of its own length as it does alone; upstream gives it those
    of the padded length (the negative control)."""
    model, reference = dynamic_models
    g = torch.Generator().manual_seed(4)
    items = []
    for n, image in ((20, True), (50, False), (8, True), (30, False)):  # expanded: 35 50 23 30
        ids = torch.randint(3, 1000, (n,), generator=g)
        if image:
            ids[1] = IMAGE_TOKEN_INDEX
        labels = ids.masked_fill(ids == IMAGE_TOKEN_INDEX, -100)
        pixels = torch.randn(3, 56, 56, generator=g) if image else torch.zeros(3, 56, 56)
        items.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "pixel_values": pixels})
    lengths = [expanded_length(torch.tensor(x["input_ids"]), P) for x in items]
    assert min(lengths) <= DYNAMIC_THRESHOLD < max(lengths), lengths
    batch = PADDED_COLLATES[collate](items)
    diffs = _row_diffs(model, reference, items, batch, lengths)
    assert max(diffs) <= 1e-5, diffs
    leaked = _row_diffs(reference, reference, items, batch, lengths)
    assert max(leaked) > 1e-4, leaked  # upstream: the padded length's frequencies
    print(
        f"padded LLaVA rows {lengths}: max |row - alone| {max(diffs):.3g}, upstream {max(leaked):.3g}"
    )


def _row_diffs(model, reference, items, batch, lengths) -> list[float]:
    """``max |row r's sample - sample r alone|`` per row of a one-sample-per-row batch through
    ``model`` (``reference``: the unpatched model itself; no boundaries then)."""
    publish = model is not reference and "cumulative_len" in batch  # llava_collate_fn's rows
    logits = _packed_logits(model, batch, publish)
    return [
        float((logits[r, :n] - _alone(reference, item)).abs().max())
        for r, (item, n) in enumerate(zip(items, lengths))
    ]


def _llm_inputs(model, items) -> dict:
    """What the patched LLaVA model's LLM got and gave for the packed ``items`` (as the
    capture hook records it: ``inputs_embeds``, ``position_ids``, ``attention_mask``,
    ``labels``, ``logits``, ``loss``)."""
    seen = {}

    def keep(module, args, kwargs, output):
        seen.update({k: v.detach() for k, v in kwargs.items() if torch.is_tensor(v)})
        seen["logits"] = output.logits.detach()

    batch = llava_collate_fn(items, max_length=400, image_tokens=P, return_hf_format=True)
    handle = model.llm.register_forward_hook(keep, with_kwargs=True)
    try:
        _packed_logits(model, batch, isolate=True)
    finally:
        handle.remove()
    seen.setdefault("labels", torch.full(seen["logits"].shape[:2], -100))
    seen["loss"] = 0.0
    return seen


def test_packed_llava_rows_on_an_unpatched_model_are_refused(models):
    _, reference = models
    batch = llava_collate_fn(
        _samples(4, seed=3), max_length=400, image_tokens=P, return_hf_format=True
    )
    hook, runner = PackedBatchCheckHook(), SimpleNamespace(model=reference)
    hook.before_val(runner)
    with pytest.raises(
        ValueError,
        match=r"batch row 0 packs 4 segments, but the model's "
        r"attention does not isolate documents",
    ):
        hook.before_val_iter(runner, 0, {"data": batch, "data_samples": None})


def test_llava_collate_refuses_bad_input():
    items = _samples(2, seed=2)
    with pytest.raises(
        ValueError,
        match=r"sample 0: \d+ tokens after its image placeholder "
        r"became 16 patch embeddings, over max_length=10",
    ):
        llava_collate_fn(items, max_length=10, image_tokens=P)
    with pytest.raises(ValueError, match=r"option image_tokens: expected an int >= 1, got 0"):
        llava_collate_fn(items, max_length=100, image_tokens=0)
    two = dict(items[0], input_ids=[5, IMAGE_TOKEN_INDEX, IMAGE_TOKEN_INDEX, 6], labels=[-100] * 4)
    with pytest.raises(
        ValueError,
        match=r"sample 0, field 'input_ids': expected at most one "
        r"image placeholder \(-200\)",
    ):
        llava_collate_fn([two], max_length=100, image_tokens=P)
    silent = [dict(x, labels=[-100] * len(x["input_ids"])) for x in items]
    with pytest.raises(ValueError, match=r"all 2 samples of the batch have no supervised label"):
        llava_collate_fn(silent, max_length=100, image_tokens=P)
    assert (
        llava_collate_fn(
            silent[:1] + items[1:], max_length=100, image_tokens=P, return_hf_format=True
        )["num_unsupervised"]
        == 1
    )
    with pytest.raises(
        TypeError,
        match=r"sample 0: expected a dict with input_ids, labels and "
        r"pixel_values",
    ):
        llava_collate_fn([{"input_ids": [1], "labels": [1]}], max_length=100, image_tokens=P)


@pytest.mark.slow
def test_tiny_llava_recipe_trains_packed_and_isolates_samples(tmp_path):
    """The tiny LLaVA recipe with ``llava_collate_fn`` through the real ``xtuner train``: the
    LLM's inputs of iteration 1 are captured and each packed sample compared with itself alone
    through the unpatched LLM."""
    from xtuner_rope.capture.llava import LLAVA_CAPTURE_FILE, compare_llava_capture

    text = (sc.REPO / "configs" / "tiny_llava_internlm2_short_dialogues.py").read_text()
    text = sc.sub_once(
        text,
        r"collate_fn=dict\(type=default_collate_fn\)",
        "collate_fn=dict(type=llava_collate_fn, max_length=256, image_tokens=16)",
    )
    text = sc.sub_once(
        text,
        r"^(from xtuner_rope import tiny_llava\n)",
        r"\g<1>from xtuner_rope import llava_collate_fn\nfrom "
        "xtuner_rope.capture.llava import LLaVAIsolationCaptureHook\n",
    )
    text = sc.sub_once(
        text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=LLaVAIsolationCaptureHook),"
    )
    config = tmp_path / "tiny_llava_packed.py"
    config.write_text(sc.sub_once(text, r"^max_epochs = 3$", "max_epochs = 1"))
    proc = sc.xtuner_train(config, tmp_path / "run", "randomness.seed=0")
    out = proc.stdout + proc.stderr
    check_run(tmp_path / "run", min_iters=6)
    assert "PackedBatchCheckHook: first batch 1 rows x" in out, out[-3000:]
    # The LLM trains through the chunked loss (the captured iteration 1 through its own).
    assert "xtuner-rope: chunked loss: the training loss projects only" in out, out[-3000:]
    result = compare_llava_capture(config, tmp_path / "run" / LLAVA_CAPTURE_FILE)
    saved = torch.load(tmp_path / "run" / LLAVA_CAPTURE_FILE, weights_only=False)
    assert saved["inputs_embeds"].shape[0] == 1 and result["samples"] == 4, result  # one row
    assert result["max_abs_diff"] <= 1e-5, result
    assert abs(result["loss"]["captured"] - result["loss"]["samples"]) <= 1e-5, result["loss"]
    print(
        f"packed LLaVA run: {result['samples']} samples in 1 row, max |trained - alone| "
        f"{result['max_abs_diff']:.3g}"
    )


def test_expanded_boundaries_refuse_what_the_expansion_cannot_keep_apart():
    from mmengine import MessageHub

    from xtuner_rope.batch.image_packing import expand_row_boundaries
    from xtuner_rope.models.llava import restart_after_expansion
    from xtuner_rope.models.runtime import CUMULATIVE_KEY, VARLEN_HUB

    ids = torch.tensor([5, IMAGE_TOKEN_INDEX, 6, 7, 0, 0])
    mask = torch.tensor([True, True, True, True, False, False])
    assert expand_row_boundaries(ids, mask, torch.tensor([0, 3, 4, 6]), P) == [3 + P - 1, 1]
    with pytest.raises(
        ValueError,
        match=r"segment \[3, 6\) has 1 real tokens of 3: expected a "
        r"sample or padding, not both",
    ):
        expand_row_boundaries(ids, mask, torch.tensor([0, 3, 6]), P)
    MessageHub.get_instance(VARLEN_HUB).update_info(
        CUMULATIVE_KEY.format(rank=0), torch.tensor([0, 3, 4, 6])
    )
    out = {"inputs_embeds": torch.zeros(1, 10, 8), "attention_mask": torch.ones(1, 10).bool()}
    try:
        with pytest.raises(
            ValueError,
            match=r"row 0, field 'cumulative_len': expected 19 tokens "
            r"after the expansion \(segments \[18, 1\]\), got 10 in XTuner's",
        ):
            restart_after_expansion(out, ids[None], mask[None], P)
    finally:
        PackedBatchCheckHook._reset()
