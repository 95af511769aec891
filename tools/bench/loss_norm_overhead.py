"""TokenWeightedLossHook overhead against one training iteration of the tiny recipe.

Batches are the recipe's (``configs/tiny_internlm2_short_dialogues.py``): 16 shuffled
dialogues collated by ``rope_collate_fn(pack=True, max_length=512, pad_to_multiple_of=64)``.
Each batch runs one full iteration through MMEngine's ``OptimWrapper`` (forward, then
``update_params``: backward, grad clip, AdamW step, zero_grad; accumulation 1 as in the
recipe, so every iteration pays the hook's step-time rescale too) twice, interleaved: on a
plain ``OptimWrapper`` and on one wrapped by the hook (its label count before the iteration
included in the timing). Prints the ratio of the medians:

    TokenWeightedLossHook overhead: X ms per iteration = Y% of a Z ms training iteration

Usage:
    python tools/bench/loss_norm_overhead.py [--quick] [--threads 1] [--batches 50]
"""

import statistics
import time
import types

import torch
from mmengine.optim import OptimWrapper
from packing import (  # tools/bench/packing.py, next to this file
    batches_of,
    load_items,
    recipe_overhead_parser,
)
from tqdm import tqdm

import xtuner_rope
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.demo.tiny import build_tiny_internlm2
from xtuner_rope.hooks import PackedBatchCheckHook
from xtuner_rope.hooks.loss_norm import TokenWeightedLossHook
from xtuner_rope.models.internlm2 import patch_internlm2_attention

# The recipe's PART 1 settings.
MAX_LENGTH, PAD_TO_MULTIPLE_OF, BATCH_SIZE = 512, 64, 16
LR, BETAS, MAX_NORM = 3e-3, (0.9, 0.98), 1.0


def parse_args():
    parser = recipe_overhead_parser(__doc__.split("\n")[0])
    args = parser.parse_args()
    args.max_length = 2048  # tokenization limit, as packing.py's load_items expects
    return args


def iteration_seconds(runner, check, wrapper, hook, data, clock):
    """One recipe iteration through ``wrapper``; the hook's label count first if ``hook``.

    ``check`` (PackedBatchCheckHook) publishes the boundaries first, untimed, as in training.
    """
    batch = {"data": dict(data), "data_samples": None}
    check.before_train_iter(runner, 0, data_batch=batch)
    start = clock()
    if hook is not None:
        hook.before_train_iter(runner, 0, data_batch=batch)
    loss = runner.model(**batch["data"]).loss
    wrapper.update_params(loss)
    elapsed = clock() - start
    check.after_train_iter(runner, 0, data_batch=batch)
    return elapsed


def main():
    args = parse_args()
    xtuner_rope.activate()  # the modules are driven directly: patches and registries first
    if args.quick:
        args.batches = min(args.batches, 15)
    torch.set_num_threads(args.threads)
    if args.clock == "auto":
        args.clock = "cpu" if args.threads == 1 else "wall"
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    items, vocab_size = load_items(args)
    batches = [
        rope_collate_fn(b, pack=True, max_length=MAX_LENGTH, pad_to_multiple_of=PAD_TO_MULTIPLE_OF)[
            "data"
        ]
        for b in batches_of(items, BATCH_SIZE)[: args.batches]
    ]
    model = build_tiny_internlm2(vocab_size, seed=args.seed, attn_implementation="sdpa").train()
    patch_internlm2_attention(model)  # what the recipe's ValidatedRoPEHook does
    # One optimizer, two wrappers: the plain one and the hook's (the step is the same work).
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS)
    clip = dict(max_norm=MAX_NORM, error_if_nonfinite=False)
    plain = OptimWrapper(optimizer, clip_grad=clip)
    weighted = OptimWrapper(optimizer, clip_grad=clip)
    hook = TokenWeightedLossHook()
    hook.wrap(weighted)
    runs = {"plain": (plain, None), "weighted": (weighted, hook)}
    runner = types.SimpleNamespace(model=model)  # all PackedBatchCheckHook reads from it
    check = PackedBatchCheckHook()
    check.before_train(runner)
    for data in batches[:2]:  # warm-up
        for wrapper, h in runs.values():
            iteration_seconds(runner, check, wrapper, h, data, clock)
    times = {name: [[] for _ in batches] for name in runs}
    with tqdm(total=args.repeats * len(batches), desc="batches", leave=False) as bar:
        for repeat in range(args.repeats):
            for i, data in enumerate(batches):
                order = list(runs.items())  # alternate who goes first (caches, clock drift)
                for name, (wrapper, h) in order[::-1] if (repeat + i) % 2 else order:
                    times[name][i].append(iteration_seconds(runner, check, wrapper, h, data, clock))
                bar.update()
    per = {name: statistics.mean(statistics.median(ts) for ts in t) for name, t in times.items()}
    direct = direct_seconds(runner, check, hook, batches, clock)
    extra = per["weighted"] - per["plain"]
    print(
        f"setup: {len(batches)} recipe batches of {BATCH_SIZE} dialogues (max_length "
        f"{MAX_LENGTH}); fp32 SDPA, AdamW, clip {MAX_NORM}, {args.threads} thread(s), "
        f"{args.clock} time, median of {args.repeats} repeats per batch"
    )
    print(
        f"TokenWeightedLossHook overhead: {1e3 * extra:.2f} ms per iteration = "
        f"{100 * extra / per['plain']:.2f}% of a {1e3 * per['plain']:.1f} ms training "
        "iteration"
    )
    print(
        f"its own work alone (label count + loss x count + gradient rescale): "
        f"{1e3 * direct:.3f} ms = {100 * direct / per['plain']:.2f}% of the iteration"
    )


def direct_seconds(runner, check, hook, batches, clock, calls=20):
    """Mean time of what the hook adds to an iteration, timed alone on the same batches.

    The label count (``before_train_iter``), the loss times the count and the rescale of
    every gradient (as at the step; one process: no all-reduce) on the model's parameters.
    """
    grads = [
        p.grad if p.grad is not None else torch.zeros_like(p) for p in runner.model.parameters()
    ]
    loss = torch.ones((), requires_grad=True)
    total = 0.0
    for data in batches:
        batch = {"data": dict(data), "data_samples": None}
        check.before_train_iter(runner, 0, data_batch=batch)
        start = clock()
        for _ in range(calls):
            hook.before_train_iter(runner, 0, data_batch=batch)
            loss * 1000  # noqa: B018 - the multiply the wrapped scale_loss does (by the count)
            torch._foreach_mul_(grads, 1.0)
        total += (clock() - start) / calls
        check.after_train_iter(runner, 0, data_batch=batch)
    return total / len(batches)


if __name__ == "__main__":
    main()
