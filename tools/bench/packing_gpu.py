"""Training steps at a real model's size on a GPU: isolated packing vs XTuner's leaky packing vs padding.

The P2/P3 measurements of ``tools/bench/packing.py`` (same sample dialogues, the same sampler
batches collated each way, interleaved steps, median per batch) on an InternLM2 with the shapes
of InternLM2-1.8B (24 layers, hidden 2048, 16/8 heads, vocab 92544), random weights, bf16 by
default, full training steps (forward, backward, AdamW) after the warm-up steps (``--warmup``:
first compiles, AdamW's state), each step timed on CUDA between two CUDA events (the batch's
copy to the device through the optimizer step, the host's work between them included) and
with ``time.perf_counter`` on the CPU. For each row capacity (``--max-length``, 4,096 and 8,192 tokens by default; each
sampler batch holds about one row's worth of dialogues):

- ``isolated``: the packed rows on the patched model (boundaries published by
  ``PackedBatchCheckHook``, the packed backend the device offers);
- ``leaky``: the same packed rows on the unpatched model, documents attending to each other, as
  the stock config without the edit trains them (XTuner without flash-attn);
- ``padded``: the same dialogues as XTuner's ``default_collate_fn`` pads them, unpatched model.

It prints the time per step, tokens/s and, on CUDA, each step's peak memory above what was
allocated before it (``torch.cuda.max_memory_allocated``; the models and optimizer states of
every variant stay resident, so only the step's own peak is comparable), against issue 48's
goals: isolated <= 1.02x the leaky step's time and <= its peak memory + 2%, packed >= 2.5x
padded tokens/s. The unpatched model serves ``leaky`` and ``padded`` alike (weights and AdamW
state shared: the timings do not depend on the values). Token ids come from the tiny demo
tokenizer (so documents are longer than with InternLM2's).

Usage:
    python tools/bench/packing_gpu.py --device cuda --shapes internlm2-1.8b
    python tools/bench/packing_gpu.py --device cpu --shapes tiny --dtype fp32 --max-length 256 \
        --train-batches 1 --repeats 1 --warmup 0
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import packing as cpu_bench  # noqa: E402 - tools/bench/packing.py, this script's sibling

import xtuner_rope  # noqa: E402
from xtuner_rope.demo.tiny import TINY_MODEL_KWARGS  # noqa: E402
from xtuner_rope.hooks import PackedBatchCheckHook  # noqa: E402
from xtuner_rope.models.dispatch import patch_model  # noqa: E402
from xtuner_rope.ops.attention import packed_backend  # noqa: E402

SHAPES = {
    "tiny": {},
    "internlm2-1.8b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=92544,
        max_position_embeddings=32768,
        rope_theta=1000000,
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="internlm2-1.8b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--data", default="data/short_dialogues.jsonl")
    parser.add_argument("--model", default="models/tiny-internlm2", help="its tokenizer is used")
    parser.add_argument(
        "--max-length",
        type=int,
        nargs="+",
        default=[4096, 8192],
        help="packed row capacities, one measurement each",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="dialogues per sampler batch (default: about one row's worth at each capacity)",
    )
    parser.add_argument("--train-batches", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_model(args, vocab_size):
    """InternLM2 (XTuner's class, SDPA) of ``--shapes``, random weights, on the device."""
    from xtuner._lite.modelings.internlm2 import InternLM2Config, InternLM2ForCausalLM

    kwargs = {**TINY_MODEL_KWARGS, "vocab_size": vocab_size, **SHAPES[args.shapes]}
    config = InternLM2Config(**kwargs, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    with torch.device(args.device):  # initialised where it trains: seconds, not minutes
        model = InternLM2ForCausalLM(config)
    return model.to(DTYPES[args.dtype])


class DeviceVariant(cpu_bench.Variant):
    """``packing.Variant`` whose batches go to the device, synchronised at the end of a step.

    On CUDA each step's peak memory above what was allocated before it is kept in ``peaks``.
    """

    def __init__(self, *args, device, optimizer=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = torch.device(device)
        if optimizer is not None:  # one model, one AdamW: leaky and padded share them
            self.optimizer = optimizer
        self.peaks = []

    def step(self, i):
        """One training step on batch ``i``; on CUDA its seconds between two CUDA events (the
        caller's clock is then not used), else None."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # nothing of the previous step in this one
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
        data = dict(self.batches[i]["data"])
        batch = {"data": data, "data_samples": None}
        if self.hook is not None:  # reads the CPU batch, publishes the boundaries
            self.hook.before_train_iter(self.runner, i, data_batch=batch)
        else:
            for key in ("cumulative_len", "max_seqlen", "num_unsupervised"):
                data.pop(key, None)
        if cuda:
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        data = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in data.items()}
        self.model(**data).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.hook is not None:
            self.hook.after_train_iter(self.runner, i, data_batch=batch)
        if cuda:
            end.record()
            end.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated(self.device) - before)
            return begin.elapsed_time(end) / 1e3
        return None


def batch_size_for(items, max_length, batch=None):
    """Dialogues per sampler batch: ``batch``, or about one row of ``max_length`` tokens."""
    if batch:
        return batch
    mean = sum(len(item["input_ids"]) for item in items) / len(items)
    return max(int(0.95 * max_length / mean), 1)


def measure_capacity(args, items, max_length, isolated, base, optimizer):
    """Time the three variants on rows of ``max_length``; returns the figures of one line."""
    args.max_length = max_length
    batch = batch_size_for(items, max_length, args.batch)
    chunk = items[: args.train_batches * batch]
    pack_batches = [cpu_bench.packed(b, args) for b in cpu_bench.batches_of(chunk, batch)]
    pad_batches = [cpu_bench.padded(b) for b in cpu_bench.batches_of(chunk, batch)]
    if not pack_batches:
        raise SystemExit(
            f"packing_gpu: {len(items)} dialogues make no batch of {batch} at max_length "
            f"{max_length}: lower --train-batches or --batch, or give more data (--data)."
        )
    variants = [
        DeviceVariant(
            "isolated", isolated, pack_batches, PackedBatchCheckHook(), device=args.device
        ),
        DeviceVariant("leaky", base, pack_batches, device=args.device, optimizer=optimizer),
        DeviceVariant("padded", base, pad_batches, device=args.device, optimizer=optimizer),
    ]
    args.clock = "wall"
    per_batch = cpu_bench.time_variants(variants, len(pack_batches), args)
    warm = min(args.warmup, len(pack_batches))
    real = sum(len(item["input_ids"]) for item in chunk[: len(pack_batches) * batch])
    return {
        "max_length": max_length,
        "batch": batch,
        "batches": len(pack_batches),
        "real": real,
        "rows": sum(b["data"]["input_ids"].shape[0] for b in pack_batches),
        "slots": {
            "packed": sum(b["data"]["input_ids"].numel() for b in pack_batches),
            "padded": sum(b["data"]["input_ids"].numel() for b in pad_batches),
        },
        "seconds": {name: sum(times) for name, times in per_batch.items()},
        # after the warm-up steps, which also allocate AdamW's state
        "peak": {v.name: max(v.peaks[warm:], default=None) for v in variants},
    }


def report(args, backend, m):
    """Two lines per capacity: the setup, then time, tokens/s and peak memory against goals."""
    t, n = m["seconds"], m["batches"]
    print(
        f"packing {args.shapes} {args.dtype} {args.device} (packed backend '{backend}'), rows of "
        f"{m['max_length']}: {n} batches of {m['batch']} dialogues, {m['real']} real tokens in "
        f"{m['rows']} packed rows; real-token share packed "
        f"{100 * m['real'] / m['slots']['packed']:.1f}%, padded "
        f"{100 * m['real'] / m['slots']['padded']:.1f}%"
    )
    gib = 1 << 30
    if m["peak"]["isolated"] is None:
        memory = "peak memory: not measured on the CPU"
    else:
        peak = m["peak"]
        memory = (
            f"step peak memory isolated {peak['isolated'] / gib:.2f} GiB | leaky "
            f"{peak['leaky'] / gib:.2f} | padded {peak['padded'] / gib:.2f} -> isolated / leaky "
            f"{peak['isolated'] / peak['leaky']:.3f}x (goal <= 1.02x)"
        )
    print(
        f"  step time isolated {1e3 * t['isolated'] / n:.1f} ms | leaky {1e3 * t['leaky'] / n:.1f}"
        f" | padded {1e3 * t['padded'] / n:.1f} -> isolated / leaky "
        f"{t['isolated'] / t['leaky']:.3f}x (goal <= 1.02x); tokens/s packed+isolated "
        f"{m['real'] / t['isolated']:.0f} | xtuner padded {m['real'] / t['padded']:.0f} -> "
        f"{t['padded'] / t['isolated']:.2f}x padded (goal >= 2.5x; ideal "
        f"{m['slots']['padded'] / m['slots']['packed']:.2f}x); {memory} "
        f"(median of {args.repeats} interleaved repeats per batch)"
    )


def main(argv=None):
    """Measure every ``--max-length``; returns the figures, one dict per capacity."""
    args = parse_args(argv)
    xtuner_rope.activate()  # the modules are driven directly: patches and registries first
    start = time.perf_counter()
    capacities = list(args.max_length)
    args.max_length = max(capacities)  # tokenized once, nothing cut below the largest row
    items, vocab_size = cpu_bench.load_items(args)
    base = build_model(args, vocab_size)
    isolated = copy.deepcopy(base)
    patch_model(isolated)
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3)
    probe = torch.zeros(1, device=args.device, dtype=DTYPES[args.dtype])
    backend = packed_backend(probe, eager=False)
    results = []
    for max_length in capacities:
        results.append(measure_capacity(args, items, max_length, isolated, base, optimizer))
        report(args, backend, results[-1])
    print(f"packing_gpu: {time.perf_counter() - start:.0f} s in all")
    return results


if __name__ == "__main__":
    main()
