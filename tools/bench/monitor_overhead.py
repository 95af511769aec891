"""PackingMetricsHook + NonFiniteTripwireHook overhead against one tiny-recipe training iteration.

Batches are the recipe's (16 shuffled dialogues, ``rope_collate_fn(pack=True, max_length=512,
pad_to_multiple_of=64)``). Per batch it times, interleaved with the iteration itself (patched
tiny InternLM2, fp32 SDPA: forward + backward + grad clip + AdamW, as the recipe does):

- the metrics hook's ``before_train_iter`` (batch figures + five MessageHub scalars);
- the tripwire's per-iteration work: keeping the batch, collecting the loss in the forward
  hook, and the check before ``optimizer.step`` (total gradient norm + one sync);

and prints the ratio of the medians:

    monitor hooks overhead: X ms per batch = Y% of a Z ms training iteration

Usage:
    python tools/bench/monitor_overhead.py [--quick] [--threads 1] [--batches 50]
"""

import statistics
import tempfile
import time
import types

import torch
from mmengine import MessageHub
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
from xtuner_rope.hooks.monitor import NonFiniteTripwireHook, PackingMetricsHook
from xtuner_rope.models.internlm2 import patch_internlm2_attention

# The recipe's PART 1 settings.
MAX_LENGTH, PAD_TO_MULTIPLE_OF, BATCH_SIZE = 512, 64, 16
LR, BETAS, MAX_NORM = 3e-3, (0.9, 0.98), 1.0


def parse_args():
    parser = recipe_overhead_parser(__doc__.split("\n")[0], clock=False)
    args = parser.parse_args()
    args.max_length = 2048  # tokenization limit, as packing.py's load_items expects
    return args


def iteration(model, optimizer, tripwire, runner, data, clock):
    """One recipe iteration; returns (seconds of the step, seconds of the hooks' work)."""
    batch = {"data": dict(data), "data_samples": None}
    runner.check.before_train_iter(runner, 0, data_batch=batch)  # untimed, runs first in a run
    hooks = _time(
        lambda: (
            runner.metrics.before_train_iter(runner, 0, data_batch=batch),
            tripwire.before_train_iter(runner, 0, data_batch=batch),
        ),
        clock,
    )
    start = clock()
    loss = model(**batch["data"]).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    # What the tripwire's forward hook and optimizer step pre-hook do in a run.
    check = _time(
        lambda: (
            tripwire._collect_losses(model, (), {"loss": loss}),
            tripwire._before_step(optimizer, (), {}),
        ),
        clock,
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = clock() - start - check
    runner.check.after_train_iter(runner, 0, data_batch=batch)
    return elapsed, hooks + check


def _time(fn, clock):
    start = clock()
    fn()
    return clock() - start


def main():
    args = parse_args()
    xtuner_rope.activate()  # the modules are driven directly: patches and registries first
    if args.quick:
        args.batches = min(args.batches, 15)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    items, vocab_size = load_items(args)
    batches = [
        rope_collate_fn(b, pack=True, max_length=MAX_LENGTH, pad_to_multiple_of=PAD_TO_MULTIPLE_OF)[
            "data"
        ]
        for b in batches_of(items, BATCH_SIZE)[: args.batches]
    ]
    model = build_tiny_internlm2(vocab_size, seed=args.seed, attn_implementation="sdpa").train()
    patch_internlm2_attention(model)  # what the recipe's ValidatedRoPEHook does
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS)
    runner = types.SimpleNamespace(
        model=model,
        iter=0,
        hooks=[],
        work_dir=tempfile.mkdtemp(),
        message_hub=MessageHub.get_instance("monitor_overhead"),
        optim_wrapper=None,
    )
    runner.check = PackedBatchCheckHook()  # publishes the boundaries, pops cumulative_len
    runner.check.before_train(runner)
    runner.metrics = PackingMetricsHook(window=10)
    runner.metrics.before_train(runner)
    tripwire = NonFiniteTripwireHook()
    tripwire._runner = runner
    for data in batches[:2]:  # warm-up
        iteration(model, optimizer, tripwire, runner, data, clock)
    step_t, hook_t = [[] for _ in batches], [[] for _ in batches]
    with tqdm(total=args.repeats * len(batches), desc="batches", leave=False) as bar:
        for _ in range(args.repeats):
            for i, data in enumerate(batches):
                runner.iter += 1
                step, hooks = iteration(model, optimizer, tripwire, runner, data, clock)
                step_t[i].append(step)
                hook_t[i].append(hooks)
                bar.update()
    per_hook = statistics.mean(statistics.median(ts) for ts in hook_t)
    per_iter = statistics.mean(statistics.median(ts) for ts in step_t)
    print(
        f"setup: {len(batches)} recipe batches of {BATCH_SIZE} dialogues, fp32 SDPA, "
        f"{args.threads} thread(s), median of {args.repeats} repeats per batch"
    )
    print(
        f"monitor hooks overhead: {1e3 * per_hook:.3f} ms per batch = "
        f"{100 * per_hook / per_iter:.2f}% of a {1e3 * per_iter:.1f} ms training iteration"
    )


if __name__ == "__main__":
    main()
