"""The random state of every process with each checkpoint: a resume draws what the run drew.

MMEngine 0.10.6 saves no random state. Before each checkpoint every rank's Python, NumPy, torch
CPU and CUDA generators go into the message hub (which checkpoints carry); on resume each rank
restores its own, after MMEngine re-read the batches already trained. docs/distributed.md.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from mmengine.dataset import DefaultSampler
from mmengine.dist import all_gather_object, get_rank, get_world_size
from mmengine.hooks import CheckpointHook, Hook
from mmengine.logging import print_log

from .optimizer_state import resume_without_optimizer_warning

STATE_KEY = "xtuner_rope.random_state"  # message-hub key: {"iter", "world_size", "ranks"}


def capture_random_state(loop=None) -> dict:
    """This process's random generators, as plain picklable values (with a train ``loop``, its
    dataloader's worker base seed too).

    Returns:
        ``{"python", "numpy", "torch_cpu", "torch_cuda", "dataloader_base_seed"}`` (None where
        there is no CUDA or no base seed).
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state()  # the current device: the one this rank trains on
    return {
        "python": random.getstate(),
        # NumPy's state as lists: loadable without allow-listing numpy types in torch.load.
        "numpy": (kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": cuda,
        "dataloader_base_seed": _base_seed(loop),
    }


def restore_random_state(state: dict) -> None:
    """Set this process's generators to a state :func:`capture_random_state` returned.

    Raises:
        ValueError: ``state`` misses a generator (not a state this hook wrote).
    """
    missing = [k for k in ("python", "numpy", "torch_cpu") if k not in state]
    if missing:
        raise ValueError(
            f"xtuner-rope: random state in the checkpoint lacks {missing}: expected the keys "
            "'python', 'numpy', 'torch_cpu' written by RandomStateHook; resume from a checkpoint "
            "written by this version, or remove its message-hub key " + STATE_KEY
        )
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch_cpu"])
    if state.get("torch_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def _base_seed(loop) -> int | None:
    """The worker base seed of the loop's current torch dataloader iterator, if any."""
    outer = getattr(loop, "dataloader_iterator", None)  # MMEngine's _InfiniteDataloaderIterator
    inner = getattr(outer, "_iterator", None)  # torch's _BaseDataLoaderIter: seeds the workers
    seed = getattr(inner, "_base_seed", None)
    return int(seed) if isinstance(seed, int) else None


class _RestoreAfterSkip:
    """The loop's dataloader iterator during MMEngine's resume skip: after the ``N``-th skipped
    batch the random state is restored and the loop's own iterator put back.
    """

    def __init__(self, loop, skip: int, state: dict) -> None:
        self.loop, self.inner, self.left, self.state = loop, loop.dataloader_iterator, skip, state

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        self.left -= 1
        if self.left == 0:
            self.loop.dataloader_iterator = self.inner
            _restore_and_log(self.state, self.loop)
        return batch


def _restore_and_log(state: dict, loop) -> None:
    restore_random_state(state)
    print_log(
        f"xtuner-rope: random state of rank {get_rank()} restored as it was after iteration "
        f"{loop.iter} (Python, NumPy, torch CPU{', CUDA' if state.get('torch_cuda') is not None else ''}).",
        logger="current",
    )
    saved, now = state.get("dataloader_base_seed"), _base_seed(loop)
    if saved is not None and now is not None and saved != now:
        print_log(
            "xtuner-rope: the resumed dataloader iterator's worker seed differs from the "
            f"checkpointed run's ({now} vs {saved}): the resume crossed an epoch boundary of the "
            "iteration-based loop, so random augmentation in the dataset workers (if any) draws "
            "other values than the uninterrupted run; the main process's generators are restored.",
            logger="current",
            level=30,
        )


class RandomStateHook(Hook):
    """Saves each process's random state with every checkpoint and restores it on resume, through
    ``MessageHub`` (key :data:`STATE_KEY`, kept across resume); changes no batch."""

    # After ParamScheduler (70), before CheckpointHook (90): captured just ahead of the save;
    # and the last ``before_train_epoch`` to run, right before the loop fetches and draws.
    priority = 85
    _restored = False  # set once this run's resume restored (or declined) its state

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        """Record the random states when ``CheckpointHook`` saves after this iteration."""
        hook = _checkpoint_hook(runner)
        if hook is None or hook.by_epoch:
            return
        if hook.every_n_train_iters(runner, hook.interval, hook.save_begin) or (
            hook.save_last and hook.is_last_train_iter(runner)
        ):
            self._record(runner, runner.iter + 1)

    def after_train_epoch(self, runner) -> None:
        """Record the random states when ``CheckpointHook`` saves after this epoch."""
        hook = _checkpoint_hook(runner)
        if hook is None or not hook.by_epoch:
            return
        if hook.every_n_epochs(runner, hook.interval, hook.save_begin) or (
            hook.save_last and hook.is_last_train_epoch(runner)
        ):
            self._record(runner, runner.iter)  # the epoch loop counted its iterations already

    def _record(self, runner, iteration: int) -> None:
        state = capture_random_state(runner.train_loop)
        states = all_gather_object(state) if get_world_size() > 1 else [state]
        record = {"iter": iteration, "world_size": len(states), "ranks": states}
        runner.message_hub.update_info(STATE_KEY, record)

    def after_load_checkpoint(self, runner, checkpoint) -> None:
        """On resume, warn when the checkpoint cannot restore the optimizer either
        (:mod:`xtuner_rope.hooks.optimizer_state`).
        """
        warning = resume_without_optimizer_warning(runner, checkpoint)
        if warning:
            print_log(warning, logger="current", level=30)

    def before_train_epoch(self, runner) -> None:
        """On resume, restore this rank's state where the uninterrupted run continued."""
        done = runner.iter
        record = runner.message_hub.get_info(STATE_KEY)
        if done == 0 or self._restored:
            return  # a fresh run, or a later epoch of a resumed one
        self._restored = True
        state = _own_state(record, done, runner)
        if state is None:
            return
        loop = runner.train_loop
        if hasattr(loop, "dataloader_iterator"):  # IterBasedTrainLoop (XTuner's TrainLoop)
            loop.dataloader_iterator = _RestoreAfterSkip(loop, done, state)  # skips `done`
        else:  # EpochBasedTrainLoop resumes at an epoch start and skips nothing
            _restore_and_log(state, loop)


def _checkpoint_hook(runner) -> CheckpointHook | None:
    return next((h for h in runner.hooks if isinstance(h, CheckpointHook)), None)


def data_order_change(saved: int, world: int, done: int, batch: int, items: int) -> str:
    """What a resume on another number of processes trains again or skips, for the log.

    ``DefaultSampler`` deals one seeded order to the ranks in turn: ``saved`` processes trained the
    first ``done * batch * saved`` items (of ``items`` an epoch), and the resume on ``world`` skips
    the first ``done * batch * world`` (the per-process batch size assumed unchanged).
    """
    before, skipped = done * batch * saved, done * batch * world
    how = (
        "MMEngine's DefaultSampler deals one order of the dataset (drawn from the seed and the "
        "epoch) to the processes in turn (rank r of W takes items r, r + W, ...), and the resume "
        f"skips {done} batches of this run's own dataloader: {done} x {batch} x {world} = "
        f"{skipped} items of that order, where the checkpointed run trained {done} x {batch} x "
        f"{saved} = {before} (the per-process batch size assumed unchanged)"
    )
    if max(before, skipped) > items:
        return f"{how}; past the first epoch of {items} items, counted within the epoch"
    if skipped < before:
        return (
            f"{how}: items {skipped + 1}-{before} of the order are trained a second time "
            f"({before - skipped} of {items})"
        )
    return (
        f"{how}: items {before + 1}-{skipped} of the order are skipped, not trained in this "
        f"epoch ({skipped - before} of {items})"
    )


def _own_state(record, done: int, runner=None) -> dict | None:
    """This rank's state from the checkpoint's record, or None (logged) when it cannot be used."""
    rank, world = get_rank(), get_world_size()
    why = None
    if not isinstance(record, dict):
        why = "the checkpoint holds no random state (written without xtuner-rope's RandomStateHook)"
    elif record.get("iter") != done:
        why = f"its random state was recorded at iteration {record.get('iter')}, not {done}"
    elif record.get("world_size") != world:
        why = f"it was written by {record.get('world_size')} process(es), this run has {world}"
        loader = getattr(runner, "train_dataloader", None)
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DefaultSampler) and isinstance(loader.batch_size, int):
            why += ". The data order changes: " + data_order_change(
                record["world_size"], world, done, loader.batch_size, len(loader.dataset)
            )
        else:  # another sampler deals items its own way: not counted here
            why += f". The data order changes ({type(sampler).__name__} deals other items)"
    if why is None:
        return record["ranks"][rank]
    print_log(
        f"xtuner-rope: resumed at iteration {done} without restoring the random state: {why}. "
        "Dropout masks (LoRA dropout included) and other random draws from here on differ from "
        "the uninterrupted run's.",
        logger="current",
        level=30,
    )
    return None


__all__ = [
    "STATE_KEY",
    "RandomStateHook",
    "capture_random_state",
    "data_order_change",
    "restore_random_state",
]
