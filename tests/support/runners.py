"""A real MMEngine Runner around a tiny model, for hook tests: built in code, on CPU, quickly.

The model is wrapped in XTuner's ``SupervisedFinetune`` (``runner.model.llm`` is the HF model,
as in ``xtuner train``), the dataloader runs ``rope_collate_fn`` over random token items, and
the hooks are registered by MMEngine itself, so their order is the runner's real order.
"""

import itertools
from pathlib import Path

import torch
from mmengine.config import ConfigDict
from mmengine.dataset import DefaultSampler
from mmengine.hooks import Hook, LoggerHook
from mmengine.runner import Runner
from transformers import AutoModelForCausalLM
from xtuner.model import SupervisedFinetune

from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.demo.resources import tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "tiny-internlm2"  # the checkpoint the stock-config runs train
_RUNS = itertools.count()  # a fresh experiment name per runner: MMEngine keys singletons on it


def token_items(lengths, vocab=256, seed=0):
    """XTuner items (``input_ids``, all-supervised ``labels``) of random ids, one per length."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    return [dict(input_ids=i, labels=list(i)) for i in ids]


def tiny_runner(
    work_dir,
    *,
    attn="sdpa",
    items=None,
    custom_hooks=(),
    max_iters=2,
    batch_size=4,
    collate_fn=None,
    lr=1e-3,
    log_interval=10,
):
    """A Runner that trains the tiny InternLM2 for ``max_iters`` iterations on ``train()``.

    The model is built as in ``xtuner train``: ``SupervisedFinetune(llm=dict(...))`` loading
    the tiny checkpoint (built on first use) with XTuner's dispatch.

    Args:
        work_dir (str | Path): Where MMEngine writes its logs.
        attn (str): The HF attention implementation, 'eager' or 'sdpa'.
        items (list[dict] | None): Dataset items; default 16 random ones of 5-40 tokens.
        custom_hooks (Sequence[dict | Hook]): As in a config's ``custom_hooks``.
        max_iters (int): Training iterations.
        batch_size (int): Items per batch, packed by ``collate_fn``.
        collate_fn (dict | None): Default ``rope_collate_fn`` packing to 64 tokens.
        lr (float): SGD learning rate.
        log_interval (int): The LoggerHook's interval (the metrics hooks' window).

    Returns:
        Runner: Built, not started; ``runner.model`` is the ``SupervisedFinetune`` wrapper.
    """
    if items is None:
        items = token_items([5 + (7 * i) % 36 for i in range(16)])
    tiny_checkpoint(str(TINY), data_path=str(REPO / "data" / "short_dialogues.jsonl"))
    llm = ConfigDict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=str(TINY),
        trust_remote_code=True,
        torch_dtype=torch.float32,
        attn_implementation=attn,
    )
    model = SupervisedFinetune(llm=llm, use_activation_checkpointing=False)
    return Runner(
        model=model,
        work_dir=str(work_dir),
        experiment_name=f"tiny_runner_{next(_RUNS)}",
        train_dataloader=dict(
            dataset=items,
            batch_size=batch_size,
            num_workers=0,
            sampler=dict(type=DefaultSampler, shuffle=False),
            collate_fn=collate_fn or dict(type=rope_collate_fn, pack=True, max_length=64),
        ),
        optim_wrapper=dict(optimizer=dict(type=torch.optim.SGD, lr=lr)),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        default_hooks=dict(checkpoint=None, logger=dict(type=LoggerHook, interval=log_interval)),
        custom_hooks=list(custom_hooks),
        log_level="WARNING",
    )


class RecordingHook(Hook):
    """Records, at each train iteration, what ``probe(runner, data_batch)`` returns.

    Registered at the given priority, it sees what the hooks of higher priority (smaller
    number) have done before it in the same stage: the runner's real order.
    """

    def __init__(self, probe, priority="NORMAL"):
        self.probe = probe
        self.priority = priority
        self.before, self.after = [], []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.before.append(self.probe(runner, data_batch))

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.after.append(self.probe(runner, data_batch))


def bare_runner(model, work_dir, custom_hooks=()):
    """A Runner around an already built ``model`` with no dataloaders (nothing to train).

    For driving hooks by hand, through their public methods, on the runner they will run in.

    Args:
        model (mmengine.model.BaseModel): E.g. XTuner's SupervisedFinetune built from a config.
        work_dir (str | Path): Where MMEngine writes its logs.
        custom_hooks (Sequence[dict | Hook]): Registered by the runner, in its order.

    Returns:
        Runner: Built, not started.
    """
    return Runner(
        model=model,
        work_dir=str(work_dir),
        custom_hooks=list(custom_hooks),
        experiment_name=f"bare_runner_{next(_RUNS)}",
        log_level="WARNING",
        default_hooks=dict(checkpoint=None),
    )
