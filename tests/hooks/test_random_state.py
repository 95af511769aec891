"""Each process's random state with every checkpoint, restored on resume (``RandomStateHook``).

In-process MMEngine ``Runner`` runs (CPU, one process) of a model with dropout on a dataset
that draws in ``__getitem__`` (``num_workers = 0``: drawn in the main process, also while MMEngine
skips the batches already trained on resume): uninterrupted, then resumed from a checkpoint in
the middle. The real ``xtuner train`` kills are in ``tests/integration/test_resume.py``.
"""

import itertools
import random

import numpy as np
import pytest
import torch
from mmengine.dataset import DefaultSampler
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch import nn

from xtuner_rope.hooks.random_state import (
    STATE_KEY,
    RandomStateHook,
    capture_random_state,
    data_order_change,
    restore_random_state,
)

_NAMES = itertools.count()


class _DropoutModel(BaseModel):
    """A linear layer behind dropout: each step's gradient depends on the drawn mask."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.linear = nn.Linear(8, 1)

    def forward(self, inputs, data_samples=None, mode="loss"):
        return {"loss": self.linear(self.dropout(inputs)).pow(2).mean()}


class _NoisyData(torch.utils.data.Dataset):
    """Items with noise drawn when read (a random augmentation in the dataset)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        return {"inputs": torch.full((8,), float(index)) / 32 + torch.rand(8)}


def _train(work_dir, hooked: bool, resume_from=None, by_epoch: bool = False) -> dict:
    torch.manual_seed(0)  # the same initial weights in every run
    runner = Runner(
        model=_DropoutModel(),
        work_dir=str(work_dir),
        experiment_name=f"random_state_{next(_NAMES)}",
        train_dataloader=dict(
            dataset=_NoisyData(),
            sampler=dict(type=DefaultSampler, shuffle=True),
            batch_size=2,
            num_workers=0,
            collate_fn=dict(type="default_collate"),
        ),
        # the epoch loop: 3 epochs of 16 iterations, a checkpoint after each epoch
        train_cfg=dict(by_epoch=True, max_epochs=3)
        if by_epoch
        else dict(by_epoch=False, max_iters=6),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
        default_hooks=dict(
            checkpoint=dict(type="CheckpointHook", by_epoch=by_epoch, interval=1 if by_epoch else 2)
        ),
        custom_hooks=[RandomStateHook()] if hooked else [],
        randomness=dict(seed=0),
        load_from=str(resume_from) if resume_from else None,
        resume=resume_from is not None,
    )
    runner.train()
    return {k: v.detach().clone() for k, v in runner.model.state_dict().items()}


@pytest.mark.parametrize("hooked", [True, False])
def test_resumed_run_draws_what_the_uninterrupted_run_drew(tmp_path, hooked):
    straight = _train(tmp_path / "straight", hooked)
    assert torch.equal(  # the same run again (deterministic): its iter_4 is the straight run's
        straight["linear.weight"], _train(tmp_path / "first", hooked)["linear.weight"]
    )
    resumed = _train(tmp_path / "resumed", hooked, resume_from=tmp_path / "first" / "iter_4.pth")
    same = all(torch.equal(straight[k], resumed[k]) for k in straight)
    # With the hook: bit for bit. Without (the negative control): dropout masks and noise from
    # the stream of a fresh start, another result.
    assert same is hooked, {k: (straight[k] - resumed[k]).abs().max() for k in straight}


def test_epoch_loop_resumed_draws_what_the_uninterrupted_run_drew(tmp_path):
    """MMEngine's ``EpochBasedTrainLoop``: resumed at an epoch start (no skip), restored at once."""
    straight = _train(tmp_path / "straight", True, by_epoch=True)
    _train(tmp_path / "first", True, by_epoch=True)
    resumed = _train(
        tmp_path / "resumed", True, resume_from=tmp_path / "first" / "epoch_2.pth", by_epoch=True
    )
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_checkpoint_carries_every_generator(tmp_path):
    _train(tmp_path / "run", True)
    hub = torch.load(tmp_path / "run" / "iter_4.pth", weights_only=False)["message_hub"]
    record = hub["runtime_info"][STATE_KEY]
    assert record["iter"] == 4 and record["world_size"] == 1
    assert set(record["ranks"][0]) == {
        "python",
        "numpy",
        "torch_cpu",
        "torch_cuda",
        "dataloader_base_seed",
    }


def test_capture_and_restore_round_trip():
    state = capture_random_state()
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    restore_random_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])


def test_restore_refuses_a_state_it_did_not_write():
    with pytest.raises(ValueError, match=r"lacks \['numpy', 'torch_cpu'\].*RandomStateHook"):
        restore_random_state({"python": random.getstate()})


@pytest.mark.parametrize(
    ("saved", "world", "expected"),
    [
        (2, 1, "items 9-16 of the order are trained a second time (8 of 32)"),
        (1, 2, "items 9-16 of the order are skipped, not trained in this epoch (8 of 32)"),
        (2, 4, "items 17-32 of the order are skipped, not trained in this epoch (16 of 32)"),
        (8, 1, "past the first epoch of 32 items, counted within the epoch"),
    ],
)
def test_data_order_change_counts_what_a_resume_trains_again_or_skips(saved, world, expected):
    text = data_order_change(saved, world, done=4, batch=2, items=32)
    assert f"this run's own dataloader: 4 x 2 x {world} = {8 * world} items" in text
    assert text.endswith(expected), text
