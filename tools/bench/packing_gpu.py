"""Training tokens/s, packed vs padded, on a model of a real size (random weights), on a GPU.

The P2 measurement of ``tools/bench/packing.py`` (same sample dialogues, same sampler batches
collated both ways, interleaved steps, median per batch) on an InternLM2 with the shapes of
InternLM2-1.8B (24 layers, hidden 2048, 16/8 heads, vocab 92544) in bf16 by default: packed
rows on the patched model (boundaries published by ``PackedBatchCheckHook``, the packed
backend the device offers) against XTuner's padded batches on the unpatched model. Full
training steps: forward, backward, AdamW; the device is synchronised inside each timed step.
Token ids come from the tiny demo tokenizer (so documents are longer than with InternLM2's).

Usage:
    python tools/bench/packing_gpu.py --device cuda --shapes internlm2-1.8b
    python tools/bench/packing_gpu.py --device cpu --shapes tiny --dtype fp32 --train-batches 2
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import packing as cpu_bench  # noqa: E402 - tools/bench/packing.py, this script's sibling

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
    parser.add_argument("--max-length", type=int, default=2048, help="packed row capacity")
    parser.add_argument("--batch", type=int, default=16, help="dialogues per sampler batch")
    parser.add_argument("--train-batches", type=int, default=8)
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
    """``packing.Variant`` whose batches go to the device, synchronised at the end of a step."""

    def __init__(self, *args, device, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = torch.device(device)

    def step(self, i):
        data = dict(self.batches[i]["data"])
        batch = {"data": data, "data_samples": None}
        if self.hook is not None:  # reads the CPU batch, publishes the boundaries
            self.hook.before_train_iter(self.runner, i, data_batch=batch)
        else:
            for key in ("cumulative_len", "max_seqlen", "num_unsupervised"):
                data.pop(key, None)
        data = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in data.items()}
        self.model(**data).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.hook is not None:
            self.hook.after_train_iter(self.runner, i, data_batch=batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    items, vocab_size = cpu_bench.load_items(args)
    items = items[: args.train_batches * args.batch]
    args.pack_batch = args.pad_batch = args.batch
    pack_batches = [cpu_bench.packed(b, args) for b in cpu_bench.batches_of(items, args.batch)]
    pad_batches = [cpu_bench.padded(b) for b in cpu_bench.batches_of(items, args.batch)]
    base = build_model(args, vocab_size)
    isolated = copy.deepcopy(base)
    patch_model(isolated)
    variants = [
        DeviceVariant(
            "isolated", isolated, pack_batches, PackedBatchCheckHook(), device=args.device
        ),
        DeviceVariant("padded", base, pad_batches, device=args.device),
    ]
    args.clock = "wall"
    times = {
        k: sum(v) for k, v in cpu_bench.time_variants(variants, len(pack_batches), args).items()
    }
    real = sum(len(item["input_ids"]) for item in items)
    slots = {
        name: sum(b["data"]["input_ids"].numel() for b in batches)
        for name, batches in (("packed", pack_batches), ("padded", pad_batches))
    }
    probe = torch.zeros(1, device=args.device, dtype=DTYPES[args.dtype])
    backend = packed_backend(probe, eager=False)
    speedup = times["padded"] / times["isolated"]
    print(
        f"packing {args.shapes} {args.dtype} {args.device} (packed backend '{backend}'): "
        f"{len(pack_batches)} batches of {args.batch} dialogues, {real} real tokens; "
        f"packed share {100 * real / slots['packed']:.1f}%, padded {100 * real / slots['padded']:.1f}%"
    )
    print(
        f"packing tokens/s: packed+isolated {real / times['isolated']:.0f} | xtuner padded "
        f"{real / times['padded']:.0f} -> {speedup:.2f}x padded (ideal "
        f"{slots['padded'] / slots['packed']:.2f}x; median of {args.repeats} interleaved "
        f"repeats per batch; total {time.perf_counter() - start:.0f} s)"
    )
    return speedup


if __name__ == "__main__":
    main()
