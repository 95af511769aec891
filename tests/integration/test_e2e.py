"""The tiny recipe end to end through XTuner's real `xtuner train` launch.

`xtuner train` exits 0 even when training crashes, so these tests judge a run by what it
produced (xtuner_rope.demo.runlog.check_run): logged losses and a saved checkpoint. The first
two run `xtuner-rope train` (the same child process, with its exit status): 0 for the run that
finished, 1 for the one that crashed.
"""

import pytest
from tiny_recipe import CONFIG, REPO, SHORT_RUN, xtuner_train  # noqa: F401 - tests/support

from xtuner_rope.demo.runlog import check_run

EVERY_ITERATION = "default_hooks.logger.interval=1"  # each iteration's loss in scalars.json
CHUNKED_LINE = "xtuner-rope: chunked loss: the training loss projects only the supervised tokens"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny recipe's short run as a user starts it (the chunked loss on by default)."""
    work_dir = tmp_path_factory.mktemp("tiny_run")
    proc = xtuner_train(work_dir, *SHORT_RUN, EVERY_ITERATION, command="xtuner-rope")
    return work_dir, proc


@pytest.mark.slow
def test_tiny_recipe_trains_and_saves(tiny_run):
    work_dir, proc = tiny_run
    run = check_run(work_dir, min_iters=30)
    assert run.iters == list(range(1, 31))
    # From ~6.9 (log of the 1024-token vocabulary) the loss must clearly fall.
    assert run.losses[-1] < run.losses[0] - 1.0, run.losses
    assert run.checkpoint.name == "iter_30.pth"
    log = next(work_dir.glob("*/*.log")).read_text()
    assert "ValidatedRoPEHook: 2 InternLM2 attention layers" in log
    assert proc.returncode == 0


def _weights(checkpoint):
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_chunked_loss_trains_as_the_models_own_loss(tiny_run, tmp_path):
    """The run above trained through the chunked loss (logged); the same run with
    ``chunked_loss = False`` (the model's own full-logits loss) gives every iteration's loss
    within 1e-6 relative and the final weights within 1e-6 (relative norm of the whole model;
    single tensors whose gradient is rounding noise, like the attention's key bias, drift
    further under AdamW, which scales noise up to the learning rate)."""
    import torch

    work_dir, _ = tiny_run
    xtuner_train(tmp_path, *SHORT_RUN, EVERY_ITERATION, "chunked_loss=False")
    chunked, own = check_run(work_dir, min_iters=30), check_run(tmp_path, min_iters=30)
    assert CHUNKED_LINE in next(work_dir.glob("*/*.log")).read_text()
    own_log = next(tmp_path.glob("*/*.log")).read_text()
    assert "chunked_loss = False: the model's own loss (full logits) runs" in own_log
    assert CHUNKED_LINE not in own_log
    assert chunked.iters == own.iters == list(range(1, 31))
    torch.testing.assert_close(chunked.losses, own.losses, rtol=1e-6, atol=0)
    got, want = _weights(chunked.checkpoint), _weights(own.checkpoint)
    assert got.keys() == want.keys()
    diff = sum(float((got[k] - want[k]).pow(2).sum()) for k in want) ** 0.5
    norm = sum(float(want[k].pow(2).sum()) for k in want) ** 0.5
    assert diff <= 1e-6 * norm, diff / norm


@pytest.mark.slow
def test_broken_recipe_is_reported_and_xtuner_rope_train_exits_1(tmp_path):
    """Break the config (rows too short for the dialogues): training must be seen as failed,
    by its outputs and by `xtuner-rope train`'s status (`xtuner train` would exit 0)."""
    proc = xtuner_train(
        tmp_path, *SHORT_RUN, "train_dataloader.collate_fn.max_length=8", command="xtuner-rope"
    )
    with pytest.raises(RuntimeError, match="crashed or never started"):
        check_run(tmp_path, min_iters=30)
    assert "rope_collate_fn: sample" in proc.stdout + proc.stderr
    assert proc.returncode == 1


@pytest.mark.slow
def test_tiny_qwen2_recipe_isolates_documents_inside_xtuner_train(tmp_path, monkeypatch):
    """The HF family's isolation measured inside a real run: iteration 1's logits, as trained,
    equal each document alone through the unpatched model (fp32, <= 1e-5)."""
    import stock_configs as sc

    text = (REPO / "configs" / "tiny_qwen2_short_dialogues.py").read_text()
    text = sc.sub_once(
        text, r"^(custom_hooks = \[)$", r"\g<1>\n    dict(type=IsolationCaptureHook),"
    )
    config = tmp_path / "tiny_qwen2.py"
    config.write_text(sc.CAPTURE_IMPORT + text)
    out = xtuner_train(
        tmp_path / "run", "train_cfg.max_epochs=None", "train_cfg.max_iters=1", config=config
    )
    assert "IsolationCaptureHook: saved" in out.stdout + out.stderr, out.stderr[-3000:]
    monkeypatch.chdir(REPO)  # the recipe's paths are relative to the repository root
    result = sc.assert_isolated_in_run(config, tmp_path / "run")
    assert result["boundaries"] == "cumulative_len"
