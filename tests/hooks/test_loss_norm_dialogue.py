"""``loss_normalization = "dialogue"``: each dialogue's mean token loss weighs the same.

The tiny InternLM2 through XTuner's ``SupervisedFinetune`` and MMEngine's ``OptimWrapper`` (SGD
lr 1, one optimizer step), the same 6 dialogues grouped three ways: packed in one micro-batch;
packed 2 per micro-batch x accumulation 3; XTuner's padded ``default_collate_fn`` 3 per
micro-batch x accumulation 2. Each equals one SGD step by hand on the mean over the dialogues of
each dialogue's mean loss, every dialogue alone through the HF model (an independent
computation); the token-weighted default and XTuner's weighting give other steps. The runs take
their per-token log-probs from the chunked loss (on by default): the packed row's logits are
never built.
"""

from __future__ import annotations

import copy

import pytest
import torch
from runners import tiny_runner, token_items
from test_loss_norm import RTOL, _relative
from vocab_tensors import VocabTensors

from xtuner_rope.batch.token_counts import dialogue_weights
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.hooks.loss_norm import TokenWeightedLossHook

LENGTHS = [5, 30, 12, 40, 9, 20]


def _one_step_by_hand(llm, items, lr=1.0):
    """SGD on the mean over dialogues of each dialogue's mean token loss (each alone)."""
    llm.zero_grad()
    for item in items:
        ids, labels = torch.tensor([item["input_ids"]]), torch.tensor([item["labels"]])
        (llm(input_ids=ids, labels=labels).loss / len(items)).backward()
    with torch.no_grad():
        for p in llm.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return {k: v.detach().clone() for k, v in llm.state_dict().items()}


def _train(tmp_path, items, *, batch_size, accumulation, mode, collate_fn=None):
    runner = tiny_runner(
        tmp_path,
        items=items,
        batch_size=batch_size,
        max_iters=len(items) // batch_size,
        collate_fn=collate_fn,
        custom_hooks=[ValidatedRoPEHook(), PackedBatchCheckHook(), TokenWeightedLossHook()],
    )
    runner.cfg["loss_normalization"] = mode
    runner.optim_wrapper = dict(
        optimizer=dict(type=torch.optim.SGD, lr=1.0), accumulative_counts=accumulation
    )
    runner.train()
    return {k: v.detach().clone() for k, v in runner.model.llm.state_dict().items()}


def test_one_step_per_dialogue_whatever_the_grouping(tmp_path):
    from xtuner.dataset.collate_fns import default_collate_fn

    items = token_items(LENGTHS)
    start = tiny_runner(tmp_path / "start", items=items).model.llm
    expected = _one_step_by_hand(copy.deepcopy(start), items)
    groupings = {
        "packed 6 x 1": dict(batch_size=6, accumulation=1),
        "packed 2 x 3": dict(batch_size=2, accumulation=3),
        "padded 3 x 2 (XTuner's collate)": dict(
            batch_size=3, accumulation=2, collate_fn=dict(type=default_collate_fn)
        ),
    }
    for i, (name, kw) in enumerate(groupings.items()):
        with VocabTensors(start.config.vocab_size) as seen:
            got = _train(tmp_path / f"g{i}", items, mode="dialogue", **kw)
        if i == 0:  # the chunked log-probs ran: no [tokens, V] logits of the packed row
            assert 0 < seen.rows < sum(LENGTHS), seen.rows
        worst = _relative(expected, got)
        print(f"dialogue mode, {name}: parameters {worst:.1e} relative to the step by hand")
        assert worst <= RTOL, name
    for mode in ("token", "micro_batch"):
        other = _relative(
            expected, _train(tmp_path / mode, items, mode=mode, batch_size=2, accumulation=3)
        )
        print(f"{mode} weighting, packed 2 x 3: {other:.1e} from the per-dialogue step")
        assert other > 100 * RTOL, mode


def test_dialogue_weights_of_a_packed_row_and_of_rows():
    labels = torch.tensor([[1, 2, 3, -100, 5, 6, -100, -100]])  # dialogues [0, 3), [3, 6), pad
    weights, dialogues = dialogue_weights(labels, [torch.tensor([0, 3, 6, 8])])
    assert dialogues == 2
    assert weights.tolist() == [[0.5, 0.5, 0.0, 0.5, 0.5, 0.0, 0.0]]
    weights, dialogues = dialogue_weights(torch.tensor([[1, 2, 3], [1, 2, -100]]))
    assert dialogues == 2 and weights.tolist() == [[0.5, 0.5], [1.0, 0.0]]


def test_dialogue_mode_refuses_sequence_parallel(monkeypatch):
    import xtuner.parallel.sequence as sp

    monkeypatch.setattr(sp, "get_sequence_parallel_world_size", lambda: 2)
    with pytest.raises(
        ValueError,
        match=r'loss_normalization = "dialogue" does not support '
        r"sequence parallel yet",
    ):
        TokenWeightedLossHook()._patch_dialogue_loss(object())


def test_dialogue_mode_refuses_other_models():
    """The per-dialogue loss replaces SupervisedFinetune's compute_loss; LLaVA's expands the
    sequence first, so its weights would not line up: refused with the default named."""
    import types

    llava = type("LLaVAModel", (torch.nn.Module,), {})()  # only its class name is read
    runner = types.SimpleNamespace(cfg={"loss_normalization": "dialogue"}, model=llava)
    with pytest.raises(
        ValueError,
        match=r'loss_normalization = "dialogue" serves XTuner\'s '
        r"SupervisedFinetune only, got LLaVAModel; use the "
        r'default "token"',
    ):
        TokenWeightedLossHook().before_train(runner)
