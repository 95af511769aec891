"""``xtuner-rope check``'s comparison of the chunked loss with the full-logits loss, tiny model.

The tiny recipe's Runner and first batch, patched as in training: the chunked loss equals the
model's own (loss, hidden-state and head gradients within 1e-6 relative in fp32), and a chunked
loss made wrong by 1e-3 is caught on each figure.
"""

from pathlib import Path

import pytest

from xtuner_rope.capture.measure import documents
from xtuner_rope.check.chunked_loss import (
    chunked_loss_lines,
    chunked_loss_problems,
    compare_chunked_loss,
)
from xtuner_rope.check.runner import apply_patch, first_batches, prepared_runner, start_config
from xtuner_rope.ops import chunked_loss as ops

REPO = Path(__file__).resolve().parents[2]
INTERNLM2 = REPO / "configs" / "tiny_internlm2_short_dialogues.py"


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        cfg = start_config(str(INTERNLM2))
        runner, _, _, hooks = prepared_runner(cfg, tmp_path_factory.mktemp("check"))
        (data_batch, recorded), *_ = first_batches(cfg, 1)
        documents(data_batch["data"], recorded, 4)  # a few rows
        assert apply_patch(runner, hooks)
        yield runner, data_batch, hooks


def test_the_chunked_loss_equals_the_full_logits_loss(patched):
    runner, data_batch, hooks = patched
    head = runner.model.llm.output.weight
    head.grad = held = head.detach().clone()  # what the check's other passes hold
    fig = compare_chunked_loss(runner, data_batch, hooks, 1e-6)
    assert head.grad is held
    assert fig["compared"] and fig["startup"].startswith("xtuner-rope: chunked loss: ")
    assert fig["head_parameters"] == ["weight"]
    assert all(v <= 1e-6 for v in fig["relative"].values()), fig
    assert fig["loss"]["chunked"] > 0 and chunked_loss_problems(fig) == []
    assert chunked_loss_lines(fig)[0].endswith("(tolerance 1e-06)  ok")


def test_a_wrong_chunked_loss_fails_on_each_figure(patched, monkeypatch):
    runner, data_batch, hooks = patched
    head_chunk = ops._head_chunk

    def off(h, t, setup, coef, grads, rows):  # 0.1% too much on every chunk
        return head_chunk(h, t, setup, coef * 1.001, grads, rows) * 1.001

    monkeypatch.setattr(ops, "_head_chunk", off)
    fig = compare_chunked_loss(runner, data_batch, hooks, 1e-6)
    problems = chunked_loss_problems(fig)
    assert [p.split(" differs")[0] for p in problems] == [
        "chunked loss: its loss",
        "chunked loss: its hidden grad",
        "chunked loss: its head grads",
    ]
    assert all(9e-4 < v < 3e-3 for v in fig["relative"].values()), fig
    assert chunked_loss_lines(fig)[0].endswith("FAIL")


def test_a_run_without_the_chunked_loss_is_not_compared():
    line = "xtuner-rope: chunked_loss = False: the model's own loss (full logits) runs."
    fig = {"startup": line, "compared": False}
    assert chunked_loss_problems(fig) == []
    assert chunked_loss_lines(fig) == [
        "  chunked  not compared: chunked_loss = False: the model's own loss (full logits) runs."
    ]
