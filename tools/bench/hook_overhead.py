"""PackedBatchCheckHook overhead against one training iteration of the tiny recipe.

Batches are the recipe's (``configs/tiny_internlm2_short_dialogues.py``): 16 shuffled
dialogues collated by ``rope_collate_fn(pack=True, max_length=512, pad_to_multiple_of=64)``.
Per batch it times the hook's work (check + publish before the iteration, reset after) and
the iteration itself (patched tiny InternLM2, fp32 SDPA: forward + backward + grad clip +
AdamW, as the recipe's OptimWrapper does), interleaved, and prints the ratio of the medians:

    PackedBatchCheckHook overhead: X ms per batch = Y% of a Z ms training iteration

Usage:
    python tools/bench/hook_overhead.py [--quick] [--threads 1] [--batches 50]
"""

import statistics
import time
import types

import torch
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
from xtuner_rope.models.internlm2 import patch_internlm2_attention

# The recipe's PART 1 settings.
MAX_LENGTH, PAD_TO_MULTIPLE_OF, BATCH_SIZE = 512, 64, 16
LR, BETAS, MAX_NORM = 3e-3, (0.9, 0.98), 1.0


def parse_args():
    parser = recipe_overhead_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--hook-calls",
        type=int,
        default=10,
        help="hook calls per timing sample (it takes about a millisecond)",
    )
    args = parser.parse_args()
    args.max_length = 2048  # tokenization limit, as packing.py's load_items expects
    return args


def hook_seconds(hook, runner, data, calls, clock):
    """Mean time of one check + publish + reset on fresh shallow copies of ``data``."""
    copies = [{"data": dict(data), "data_samples": None} for _ in range(calls)]
    start = clock()
    for batch in copies:
        hook.before_train_iter(runner, 0, data_batch=batch)
        hook.after_train_iter(runner, 0, data_batch=batch)
    return (clock() - start) / calls


def train_seconds(hook, runner, data, optimizer, clock):
    """One recipe iteration on ``data``: the hook publishes (untimed), then the step is timed."""
    batch = {"data": dict(data), "data_samples": None}
    hook.before_train_iter(runner, 0, data_batch=batch)
    model = runner.model
    start = clock()
    loss = model(**batch["data"]).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = clock() - start
    hook.after_train_iter(runner, 0, data_batch=batch)
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS)
    runner = types.SimpleNamespace(model=model)  # all the hook reads from the runner
    hook = PackedBatchCheckHook()
    hook.before_train(runner)
    for data in batches[:2]:  # warm-up
        hook_seconds(hook, runner, data, 1, clock)
        train_seconds(hook, runner, data, optimizer, clock)
    hook_t = [[] for _ in batches]
    train_t = [[] for _ in batches]
    with tqdm(total=args.repeats * len(batches), desc="batches", leave=False) as bar:
        for _ in range(args.repeats):
            for i, data in enumerate(batches):
                hook_t[i].append(hook_seconds(hook, runner, data, args.hook_calls, clock))
                train_t[i].append(train_seconds(hook, runner, data, optimizer, clock))
                bar.update()
    per_hook = statistics.mean(statistics.median(ts) for ts in hook_t)
    per_iter = statistics.mean(statistics.median(ts) for ts in train_t)
    rows = statistics.mean(data["input_ids"].shape[0] for data in batches)
    s = statistics.mean(data["input_ids"].shape[1] for data in batches)
    print(
        f"setup: {len(batches)} recipe batches of {BATCH_SIZE} dialogues -> mean {rows:.2f} "
        f"rows x s {s:.0f} (max_length {MAX_LENGTH}, pad_to_multiple_of {PAD_TO_MULTIPLE_OF}); "
        f"fp32 SDPA, {args.threads} thread(s), {args.clock} time, median of {args.repeats} "
        "repeats per batch"
    )
    print(
        f"PackedBatchCheckHook overhead: {1e3 * per_hook:.2f} ms per batch = "
        f"{100 * per_hook / per_iter:.2f}% of a {1e3 * per_iter:.1f} ms training iteration"
    )


if __name__ == "__main__":
    main()
