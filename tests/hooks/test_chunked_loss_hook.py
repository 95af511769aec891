"""``chunked_loss`` in a real MMEngine run of the tiny InternLM2 (``hooks.chunked_loss``): the
training loss goes through the chunked loss (no logits of more than a chunk), logged; the
per-iteration losses and final weights equal a run with ``chunked_loss = False``; the held-out
metric's per-dialogue NLL and worst-dialogues file from the chunked ``predict`` equal the full
logits'; bad values and unserved modes are refused or named."""

import json

import pytest
import torch
from runners import tiny_runner
from vocab_tensors import VocabTensors

from xtuner_rope.config.loss import chunked_loss_setting
from xtuner_rope.config.startup import inspect_config
from xtuner_rope.evaluation.metric import WORST_FILE, TokenLossMetric
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.hooks.chunked_loss import enable_chunked_loss
from xtuner_rope.models import channel
from xtuner_rope.ops.packing import flat_cumulative


def _train(tmp_path, setting):
    runner = tiny_runner(
        tmp_path / str(setting),
        max_iters=4,
        log_interval=1,
        custom_hooks=[dict(type=ValidatedRoPEHook), dict(type=PackedBatchCheckHook)],
    )
    if setting is not None:
        runner.cfg["chunked_loss"] = setting
    losses = []
    orig = runner.model.train_step

    def train_step(data, optim_wrapper):
        out = orig(data, optim_wrapper)
        losses.append(float(out["loss"].detach()))
        return out

    runner.model.train_step = train_step
    # Every new vocabulary-sized tensor of the run (the head's call reads its weight, not the
    # module: a forward hook on it would see nothing).
    with VocabTensors(runner.model.llm.config.vocab_size) as seen:
        runner.train()
    weights = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    return losses, weights, seen.rows


def test_chunked_run_equals_the_opt_out_run(tmp_path):
    chunked = _train(tmp_path, 16)  # chunks of 16 tokens: several per micro-batch
    own = _train(tmp_path, False)
    assert 0 < chunked[2] <= 16  # at most a chunk of supervised tokens' logits at a time
    assert own[2] >= 64  # the whole rows' logits (rows of 64 tokens)
    torch.testing.assert_close(chunked[0], own[0], rtol=1e-6, atol=0)
    for name, w in own[1].items():
        torch.testing.assert_close(chunked[1][name], w, rtol=1e-6, atol=1e-8, msg=name)


def test_start_up_lines_say_which_loss_runs(tmp_path):
    runner = tiny_runner(tmp_path / "a")
    ValidatedRoPEHook()._patch(runner)
    line = enable_chunked_loss(runner)
    assert "chunked loss: the training loss projects only the supervised tokens" in line
    assert (
        "nn.Linear(64, " in line and "chunks of" in line and "opt out: chunked_loss = False" in line
    )
    assert enable_chunked_loss(runner) == line  # idempotent
    runner = tiny_runner(tmp_path / "b")
    runner.cfg["chunked_loss"] = False
    assert "chunked_loss = False: the model's own loss" in enable_chunked_loss(runner)
    runner.cfg["chunked_loss"] = 16
    assert "chunks of 16 supervised tokens" in enable_chunked_loss(runner)


def test_a_compute_loss_replaced_by_unknown_code_keeps_the_models_loss(tmp_path):
    """Only our own replacements (the dialogue mode's, marked) are served; any other instance
    ``compute_loss`` may read the full logits."""
    runner = tiny_runner(tmp_path)
    runner.model.compute_loss = lambda data, data_samples=None: None
    assert "its compute_loss is replaced by code that reads" in enable_chunked_loss(runner)


@pytest.mark.parametrize("value", ["yes", 0, -5, 1.5])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match=r"chunked_loss: expected True, False or a number"):
        chunked_loss_setting({"chunked_loss": value})
    from mmengine.config import Config

    findings = inspect_config(Config(dict(chunked_loss=value)))
    assert any(f.setting == "chunked_loss" for f in findings)


def test_a_model_it_does_not_serve_keeps_its_own_loss_and_says_why():
    """Another model (a bare causal LM here; LLaVA, InternVL, the reward model) is left alone."""
    import types

    from xtuner_rope.demo.tiny import build_tiny

    llm = build_tiny("internlm2", 97)
    runner = types.SimpleNamespace(cfg={}, model=llm)
    line = enable_chunked_loss(runner)
    assert "the model's own loss (full logits) runs: InternLM2ForCausalLM's loss is not" in line
    assert "_xtuner_rope_own_forward" not in vars(llm)


def _heldout(model, data, bounds, work):
    """``TokenLossMetric`` on one batch through ``model.predict`` (as ``val_step``); the
    per-dialogue results, the worst-dialogues file, the widest logits seen."""
    metric = TokenLossMetric(worst=4)
    metric.output_dir = str(work)
    work.mkdir()
    channel.publish(flat_cumulative(bounds, data["input_ids"].shape[1]), 40)
    try:
        with torch.no_grad(), VocabTensors(model.llm.config.vocab_size) as seen:
            metric.process({"data": data}, model.predict(dict(data)))
    finally:
        channel.clear()
    metric.compute_metrics(metric.results)
    docs = [d for result in metric.results for d in result["documents"]]
    worst = [json.loads(x) for x in (work / WORST_FILE).read_text().splitlines()]
    return docs, worst, seen.rows


def test_heldout_from_the_chunked_predict_equals_the_full_logits(tmp_path):
    """Packed held-out rows (documents isolated, boundaries on the channel): the per-dialogue
    NLL within 1e-6 relative and the same worst dialogues, without the rows' logits."""
    runner = tiny_runner(tmp_path / "run")
    ValidatedRoPEHook()._patch(runner)
    model = runner.model.eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [[7, 19, 5, 9], [23, 12, 5]]
    ids = torch.randint(6, model.llm.config.vocab_size, (2, 40), generator=gen)
    labels = ids.clone()
    labels[torch.rand(2, 40, generator=gen) < 0.3] = -100
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    bounds = [torch.tensor([0, *torch.tensor(row).cumsum(0).tolist()]) for row in lengths]
    data = {"input_ids": ids, "labels": labels, "position_ids": positions}
    full = _heldout(model, data, bounds, tmp_path / "full")
    runner.cfg["chunked_loss"] = 8
    enable_chunked_loss(runner)
    chunked = _heldout(model, data, bounds, tmp_path / "chunked")
    assert full[2] >= ids.numel() and 0 < chunked[2] <= 8  # no [tokens, V] when chunked
    assert [d["tokens"] for d in chunked[0]] == [d["tokens"] for d in full[0]]
    assert len(full[0]) == 7
    for got, want in zip(chunked[0], full[0]):
        assert got["first_ids"] == want["first_ids"]
        assert abs(got["nll"] - want["nll"]) <= 1e-6 * abs(want["nll"]), (got, want)
    for got, want in zip(chunked[1], full[1]):
        assert {**got, "mean_nll": 0} == {**want, "mean_nll": 0}
        assert abs(got["mean_nll"] - want["mean_nll"]) <= 1e-6 * want["mean_nll"]
