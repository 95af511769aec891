"""MMEngine patch: checks run before the parameter schedulers are built (the warm-up that rounds to 0)."""

from __future__ import annotations

import functools

import torch

# Checks run on the schedulers MMEngine is about to build, (schedulers, iterations per epoch,
# a description of the data) -> None or raise; the start-up's warm-up check registers itself here
# (``xtuner_rope.config.warmup``), as compat may not import the start-up.
SCHEDULER_CHECKS: list = []


def patch_mmengine_warmup_rounding() -> bool:
    """Turn "end should be larger than begin, but got begin=0, end=0" into an error naming the
    warm-up, the dataset's length and the edit (``xtuner_rope.config.warmup``).

    mmengine 0.10.x ``Runner._build_param_scheduler`` converts an epoch-based scheduler with
    ``convert_to_iter_based=True`` by truncating ``end * len(train_dataloader)``; XTuner's stock
    warm-up (``end=warmup_ratio * max_epochs``) becomes 0 iterations on a small dataset and the
    scheduler's constructor raises a ``ValueError`` that names neither. The check runs just
    before the original, with the same dataloader; nothing else changes.

    Returns:
        True if applied (mmengine's Runner has ``_build_param_scheduler``).
    """
    try:
        from mmengine.runner import Runner
    except ImportError:
        return False
    original = getattr(Runner, "_build_param_scheduler", None)
    if original is None:
        return False

    @functools.wraps(original)
    def build(self, scheduler, optim_wrapper):
        from mmengine.runner import BaseLoop

        if isinstance(self._train_loop, BaseLoop) and SCHEDULER_CHECKS:
            loader = self.train_dataloader
            length = len(loader)
            samples = len(loader.dataset) if hasattr(loader.dataset, "__len__") else "?"
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            for check in SCHEDULER_CHECKS:
                check(
                    scheduler,
                    length,
                    f"{samples} samples, batch size {loader.batch_size}, {world} process(es)",
                )
        return original(self, scheduler, optim_wrapper)

    Runner._build_param_scheduler = build
    return True
