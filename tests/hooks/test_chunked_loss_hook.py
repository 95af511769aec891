"""``chunked_loss`` in a real MMEngine run of the tiny InternLM2 (``hooks.chunked_loss``): the
training loss goes through the chunked loss (the head sees only supervised tokens), logged; the
per-iteration losses and final weights equal a run with ``chunked_loss = False``; bad values
and unserved modes are refused or named."""

import pytest
import torch
from runners import tiny_runner

from xtuner_rope.config.loss import chunked_loss_setting
from xtuner_rope.config.startup import inspect_config
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.hooks.chunked_loss import enable_chunked_loss


def _train(tmp_path, setting):
    runner = tiny_runner(
        tmp_path / str(setting),
        max_iters=4,
        log_interval=1,
        custom_hooks=[dict(type=ValidatedRoPEHook), dict(type=PackedBatchCheckHook)],
    )
    if setting is not None:
        runner.cfg["chunked_loss"] = setting
    head_inputs, losses = [], []
    runner.model.llm.output.register_forward_hook(
        lambda m, args, out: head_inputs.append(tuple(args[0].shape))
    )
    orig = runner.model.train_step

    def train_step(data, optim_wrapper):
        out = orig(data, optim_wrapper)
        losses.append(float(out["loss"].detach()))
        return out

    runner.model.train_step = train_step
    runner.train()
    weights = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    return losses, weights, head_inputs


def test_chunked_run_equals_the_opt_out_run(tmp_path):
    chunked = _train(tmp_path, 16)  # chunks of 16 tokens: several per micro-batch
    own = _train(tmp_path, False)
    assert all(len(shape) == 2 for shape in chunked[2])  # [k, H]: supervised tokens only
    assert all(len(shape) == 3 for shape in own[2])  # [b, s, H]: the whole rows
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


def test_dialogue_normalization_keeps_the_models_loss(tmp_path):
    runner = tiny_runner(tmp_path)
    runner.model.compute_loss = lambda data, data_samples=None: None  # what that mode installs
    assert 'loss_normalization = "dialogue" computes its loss' in enable_chunked_loss(runner)


@pytest.mark.parametrize("value", ["yes", 0, -5, 1.5])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match=r"chunked_loss: expected True, False or a number"):
        chunked_loss_setting({"chunked_loss": value})
    from mmengine.config import Config

    findings = inspect_config(Config(dict(chunked_loss=value)))
    assert any(f.setting == "chunked_loss" for f in findings)


def test_a_model_it_does_not_serve_keeps_its_own_loss_and_says_why():
    """Another XTuner model (DPO reads the logits of its forward, LLaVA...) is left alone."""
    import types

    from xtuner_rope.demo.tiny import build_tiny

    llm = build_tiny("internlm2", 97)
    runner = types.SimpleNamespace(cfg={}, model=llm)
    line = enable_chunked_loss(runner)
    assert "the model's own loss (full logits) runs: InternLM2ForCausalLM's loss is not" in line
    assert "_xtuner_rope_own_forward" not in vars(llm)
