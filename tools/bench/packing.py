"""Packing benchmark: real-token share and training speed of rope_collate_fn vs XTuner padding.

On our sample short dialogues and the tiny InternLM2 and Qwen2 (fp32,
``attn_implementation='sdpa'``), in one run:

- P1: real tokens / ``input_ids`` positions of ``rope_collate_fn(pack=True)`` batches against
  XTuner's ``default_collate_fn`` (padding to the longest dialogue of the batch), over the
  whole shuffled data set, plus the packed share for other sampler batch sizes.
- P2: real tokens per second of full training steps (forward + backward + AdamW): packed
  rows on the patched model, boundaries published by ``PackedBatchCheckHook`` (its check is
  timed as part of the step), against padded batches on the unpatched model.
- P3: the same packed batches on the unpatched model (positions restart per document but
  documents attend to each other, as XTuner without flash-attn): isolated / leaky step time.

Fairness: the three models are copies of one seeded init; P2/P3 collate the same sampler
batches of dialogues both ways, so every variant trains on the same real tokens. Steps are
interleaved per batch (order rotated) and each batch's time is the median over repeats,
so a burst of load from other processes hits every variant alike.

Usage:
    python tools/bench/packing.py [--quick] [--threads 1] [--repeats 3]
"""

import argparse
import copy
import json
import random
import statistics
import time
import types

import torch
from tqdm import tqdm

import xtuner_rope
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.demo.resources import tiny_checkpoint
from xtuner_rope.demo.tiny import build_tiny
from xtuner_rope.hooks import PackedBatchCheckHook
from xtuner_rope.models.dispatch import patch_model

SHARE_SWEEP = (8, 16, 24, 32, 64, 128, 256, 600)  # packed share for these batch sizes too


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_options(parser)
    parser.add_argument("--max-length", type=int, default=2048, help="packed row capacity")
    parser.add_argument(
        "--pack-batch",
        type=int,
        default=16,
        help="dialogues per sampler batch for packing (P1 line, P2, P3)",
    )
    parser.add_argument(
        "--pad-batch",
        type=int,
        default=16,
        help="dialogues per XTuner padded batch (default_collate_fn)",
    )
    parser.add_argument(
        "--train-batches",
        type=int,
        default=48,
        help="sampler batches timed in P2/P3 (a prefix of the shuffled data)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed passes (median per batch)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per variant")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads; 1 is steadiest on a shared 2-core box",
    )
    parser.add_argument(
        "--clock",
        choices=("auto", "cpu", "wall"),
        default="auto",
        help="cpu: process CPU time, immune to time-slicing by other processes "
        "(auto picks it for --threads 1; OpenMP spin-waits inflate it otherwise)",
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle and model-init seed")
    parser.add_argument(
        "--families",
        default="internlm2,qwen2",
        help="comma-separated tiny models for P2/P3: internlm2, qwen2, llama",
    )
    parser.add_argument("--quick", action="store_true", help="16 timed batches: ~1-2 minutes")
    return parser.parse_args()


def recipe_overhead_parser(description: str, clock: bool = True) -> argparse.ArgumentParser:
    """The options the recipe-overhead benches share (hook, monitor and loss-weighting overhead).

    Their batches are the tiny recipe's; ``load_items`` needs ``args.max_length``, which each
    bench sets to 2048 (the tokenization limit) after parsing.
    """
    parser = argparse.ArgumentParser(description=description)
    add_data_options(parser)
    parser.add_argument("--batches", type=int, default=50, help="recipe batches timed")
    add_timing_options(parser, repeats=3, clock=clock)
    parser.add_argument("--quick", action="store_true", help="15 batches")
    return parser


def add_data_options(parser: argparse.ArgumentParser) -> None:
    """``--data`` (the sample dialogues) and ``--model`` (whose tokenizer tokenizes them)."""
    parser.add_argument("--data", default="data/short_dialogues.jsonl")
    parser.add_argument(
        "--model",
        default="models/tiny-internlm2",
        help="tiny checkpoint whose tokenizer is used (built if missing)",
    )


def add_timing_options(parser: argparse.ArgumentParser, repeats: int, clock: bool = True) -> None:
    """``--repeats``, ``--threads``, ``--clock`` and ``--seed``, as the CPU benches read them."""
    parser.add_argument("--repeats", type=int, default=repeats, help="timed passes (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    if clock:
        parser.add_argument(
            "--clock",
            choices=("auto", "cpu", "wall"),
            default="auto",
            help="cpu: process CPU time (auto picks it for --threads 1)",
        )
    parser.add_argument("--seed", type=int, default=0, help="shuffle and model-init seed")


def load_items(args):
    """The dialogues tokenized as XTuner does (internlm2_chat template), shuffled by seed."""
    import datasets
    from transformers import AutoTokenizer
    from xtuner.dataset import process_hf_dataset
    from xtuner.dataset.map_fns import openai_map_fn, template_map_fn_factory
    from xtuner.utils import PROMPT_TEMPLATE

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint(args.model, data_path=args.data))
    with open(args.data, encoding="utf-8") as f:
        dialogues = [json.loads(line) for line in f if line.strip()]
    dataset = process_hf_dataset(
        dataset=datasets.Dataset.from_list(dialogues),
        tokenizer=tokenizer,
        max_length=args.max_length,
        dataset_map_fn=openai_map_fn,
        template_map_fn=template_map_fn_factory(template=PROMPT_TEMPLATE.internlm2_chat),
        pack_to_max_length=False,
        remove_unused_columns=True,
        map_num_proc=1,
    )
    items = [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in dataset]
    random.Random(args.seed).shuffle(items)
    return items, len(tokenizer)


def batches_of(items, n):
    """Consecutive sampler batches of ``n`` items (the last, shorter one dropped)."""
    return [items[i : i + n] for i in range(0, len(items) - n + 1, n)]


def real_share(batches, collate):
    """Real tokens / ``input_ids`` positions over all batches collated by ``collate``."""
    real = sum(len(item["input_ids"]) for batch in batches for item in batch)
    total = sum(collate(batch)["data"]["input_ids"].numel() for batch in batches)
    return real / total


def packed(batch, args):
    return rope_collate_fn(batch, pack=True, max_length=args.max_length)


def padded(batch):
    from xtuner.dataset.collate_fns import default_collate_fn

    return default_collate_fn(batch)


def report_share(items, args):
    """P1 lines; returns nothing (shares of the timed subset are printed with P2)."""
    pack_share = real_share(batches_of(items, args.pack_batch), lambda b: packed(b, args))
    pad_share = real_share(batches_of(items, args.pad_batch), padded)
    mean_len = statistics.mean(len(item["input_ids"]) for item in items)
    print(
        f"P1 real-token share: packed {100 * pack_share:.1f}% ({args.pack_batch} dialogues/"
        f"batch, rows <= {args.max_length}) | xtuner padded({args.pad_batch}) "
        f"{100 * pad_share:.1f}%   [{len(items)} dialogues, mean {mean_len:.1f} tokens, "
        f"seed {args.seed}]"
    )
    shares = [real_share(batches_of(items, n), lambda b: packed(b, args)) for n in SHARE_SWEEP]
    sweep = "  ".join(f"{n}: {100 * share:.1f}%" for n, share in zip(SHARE_SWEEP, shares))
    print(f"P1 packed share by dialogues/batch: {sweep}")


class Variant:
    """One model + AdamW, and how a collated batch is fed to it."""

    def __init__(self, name, model, batches, publish_hook=None):
        self.name, self.model, self.batches = name, model.train(), batches
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.hook = publish_hook
        self.runner = types.SimpleNamespace(model=model)  # what the hook reads: runner.model
        if publish_hook is not None:
            publish_hook.before_train(self.runner)

    def step(self, i):
        data = dict(self.batches[i]["data"])  # the hook pops keys: keep the stored batch whole
        batch = {"data": data, "data_samples": None}
        if self.hook is not None:
            self.hook.before_train_iter(self.runner, i, data_batch=batch)
        else:  # the HF forward takes no boundaries
            data.pop("cumulative_len", None)
            data.pop("max_seqlen", None)
            data.pop("num_unsupervised", None)
        loss = self.model(**data).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.hook is not None:
            self.hook.after_train_iter(self.runner, i, data_batch=batch)


def time_variants(variants, n_batches, args):
    """``times[name][i]``: median seconds of batch ``i`` over the repeats, interleaved, after
    ``args.warmup`` untimed steps of each variant."""
    for v in variants:
        for i in range(min(args.warmup, n_batches)):
            v.step(i)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    samples = {v.name: [[] for _ in range(n_batches)] for v in variants}
    bar = tqdm(total=args.repeats * n_batches, desc="timed steps (x3 variants)", leave=False)
    for r in range(args.repeats):
        for i in range(n_batches):
            k = (i + r) % len(variants)  # rotate the order: no variant always runs first
            for v in variants[k:] + variants[:k]:
                start = clock()
                took = v.step(i)  # a step may time itself (CUDA events: tools/bench/packing_gpu.py)
                samples[v.name][i].append(clock() - start if took is None else took)
            bar.update()
    bar.close()
    return {name: [statistics.median(ts) for ts in per] for name, per in samples.items()}


def report_speed(items, vocab_size, args, family):
    """P2 and P3 lines for the tiny model of ``family`` (InternLM2, or transformers' Qwen2)."""
    if args.pack_batch != args.pad_batch:
        raise SystemExit("P2/P3 pair batches one to one: use --pack-batch == --pad-batch.")
    train_items = items[: args.train_batches * args.pack_batch]
    pack_batches = [packed(b, args) for b in batches_of(train_items, args.pack_batch)]
    pad_batches = [padded(b) for b in batches_of(train_items, args.pad_batch)]
    base = build_tiny(family, vocab_size, seed=args.seed, attn_implementation="sdpa")
    isolated = copy.deepcopy(base)
    patch_model(isolated)
    variants = [
        Variant("isolated", isolated, pack_batches, PackedBatchCheckHook()),
        Variant("padded", copy.deepcopy(base), pad_batches),
        Variant("leaky", base, pack_batches),
    ]
    times = {k: sum(v) for k, v in time_variants(variants, len(pack_batches), args).items()}
    real = sum(len(item["input_ids"]) for item in train_items)
    pack_share = real / sum(b["data"]["input_ids"].numel() for b in pack_batches)
    pad_share = real / sum(b["data"]["input_ids"].numel() for b in pad_batches)
    rows = [b["data"]["input_ids"].shape for b in pack_batches]
    pad_s = statistics.mean(b["data"]["input_ids"].shape[1] for b in pad_batches)
    speedup, ideal = times["padded"] / times["isolated"], 1 / pad_share
    print(
        f"[{family}] P2 setup: {len(pack_batches)} batches of {args.pack_batch} dialogues ({real} real "
        f"tokens), packed -> {statistics.mean(r[0] for r in rows):.2f} rows x mean s "
        f"{statistics.mean(r[1] for r in rows):.0f} (share {100 * pack_share:.1f}%) | padded "
        f"[{args.pad_batch}, mean s {pad_s:.0f}] "
        f"(share {100 * pad_share:.1f}%); fp32, {args.threads} thread(s), {args.clock} time, "
        f"median of {args.repeats} interleaved repeats per batch"
    )
    print(
        f"[{family}] P2 tokens/s: packed+isolated {real / times['isolated']:.0f} | xtuner padded "
        f"{real / times['padded']:.0f} -> {speedup:.2f}x xtuner padded (ideal {ideal:.2f}x, "
        f"{100 * speedup / ideal:.0f}% of ideal)"
    )
    print(
        f"[{family}] P3 step time: isolated / leaky packed = {times['isolated'] / times['leaky']:.2f}x "
        f"({1e3 * times['isolated'] / len(rows):.1f} ms vs "
        f"{1e3 * times['leaky'] / len(rows):.1f} ms per batch)"
    )


def main():
    args = parse_args()
    xtuner_rope.activate()  # the modules are driven directly: patches and registries first
    if args.quick:
        args.train_batches = min(args.train_batches, 16)
    torch.set_num_threads(args.threads)
    if args.clock == "auto":
        args.clock = "cpu" if args.threads == 1 else "wall"
    start = time.perf_counter()
    items, vocab_size = load_items(args)
    report_share(items, args)
    for family in args.families.split(","):
        report_speed(items, vocab_size, args, family)
    print(f"(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
