"""Time the validated rotary's cos/sin on packed rows: per-document frequencies and their cost.

One model-level rotary call (``HFValidatedRotaryEmbedding``, what a transformers family runs
once per forward) on one packed row of ``--seq`` tokens, documents of ``--docs`` lengths,
position ids restarting per document. Rows printed as milliseconds and as ratios to the first:

- ``default``: no scaling (the common case, unchanged path);
- ``dynamic-short``: dynamic NTK, every document within ``max_position_embeddings`` (unchanged
  path: no per-document work below the threshold);
- ``dynamic-mixed``: documents below and above the threshold, each with its own frequencies;
- ``dynamic-mixed-per-call``: the same row with ``per_document = False`` (upstream's choice,
  one set of frequencies: what per-document frequencies cost on top);
- ``dynamic-mixed-host``: the mixed row with its boundaries published on the host, as
  ``PackedBatchCheckHook`` publishes them (range and document lengths from the host, no read);
- ``internlm2-dynamic-mixed-x{L}``: InternLM2's rotary (one module per layer, as the model has)
  called by ``--layers`` layers with the same position ids, the mixed row: what one forward's
  tables cost (computed once and shared, or once per layer).

Usage:
    python tools/bench/rope_documents.py --seq 4096 --repeats 50 --threads 2 --layers 24
    PYTHONPATH=<older checkout> python tools/bench/rope_documents.py ...  # before/after
"""

import argparse
import statistics
import time

import torch
from tqdm import tqdm
from transformers import LlamaConfig

from xtuner_rope.models import channel
from xtuner_rope.models.hf_rope import HFValidatedRotaryEmbedding
from xtuner_rope.models.internlm2_rope import ValidatedRotaryEmbedding
from xtuner_rope.ops.packing import cumulative_from_lengths


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096, help="tokens of the packed row")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threshold", type=int, default=2048, help="max_position_embeddings")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=24, help="InternLM2 layers per forward")
    return parser.parse_args()


class HostBoundaries:
    """A rotary called with the row's boundaries published on the host (one batch's)."""

    def __init__(self, module, lengths: list[int]):
        self.module, self.cu = module, cumulative_from_lengths(lengths)

    def __call__(self, x, positions):
        channel.publish(self.cu, max(int(n) for n in self.cu.diff()), rank=0)
        try:
            return self.module(x, positions)
        finally:
            channel.clear(rank=0)


class InternLM2Layers:
    """One forward's rotary calls of an InternLM2 model: a module per layer, same positions."""

    def __init__(self, args, layers: int):
        self.modules = [
            ValidatedRotaryEmbedding(
                args.head_dim, args.threshold, 10000, "dynamic", 4.0, device=args.device
            )
            for _ in range(layers)
        ]
        self.v = torch.zeros(1, 1, args.seq, args.head_dim, device=args.device)  # [b, n_kv, s, h_d]

    def __call__(self, x, positions):
        v = self.v[:, :, : positions.shape[1]]
        for module in self.modules:
            module(v, positions)


def packed_positions(lengths: list[int], device) -> torch.Tensor:
    """``[1, sum(lengths)]`` position ids restarting at every document."""
    return torch.cat([torch.arange(n) for n in lengths])[None].to(device)


def rotary(args, scaling: dict | None) -> HFValidatedRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=args.head_dim * 8,
        num_attention_heads=8,
        max_position_embeddings=args.threshold,
        rope_scaling=scaling,
    )
    return HFValidatedRotaryEmbedding(config, device=torch.device(args.device))


def cases(args) -> dict:
    """name -> (rotary, position ids)."""
    t, seq = args.threshold, args.seq
    short = [t // 8] * (seq // (t // 8))  # many documents, all within the threshold
    mixed = [t // 8, t + t // 2, t // 4]  # below, above, below
    mixed += [t // 16] * ((seq - sum(mixed)) // (t // 16))
    dynamic = dict(rope_type="dynamic", factor=4.0)
    off = rotary(args, dynamic)
    if not hasattr(off, "per_document"):  # an older checkout: one set per call anyway
        off = None
    else:
        off.per_document = False
    out = {
        "default": (rotary(args, None), packed_positions(short, args.device)),
        "dynamic-short": (rotary(args, dynamic), packed_positions(short, args.device)),
        "dynamic-mixed": (rotary(args, dynamic), packed_positions(mixed, args.device)),
    }
    if off is not None:
        out["dynamic-mixed-per-call"] = (off, packed_positions(mixed, args.device))
    host = HostBoundaries(rotary(args, dynamic), mixed)
    out["dynamic-mixed-host"] = (host, packed_positions(mixed, args.device))
    out[f"internlm2-dynamic-mixed-x{args.layers}"] = (
        InternLM2Layers(args, args.layers),
        packed_positions(mixed, args.device),
    )
    return out


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    runs = cases(args)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    times = {name: [] for name in runs}
    x = torch.zeros(1, args.seq, 8, device=args.device)
    for _ in tqdm(range(args.repeats), desc="rotary bench", leave=False, disable=None):
        for name, (module, positions) in runs.items():  # interleaved: noise hits all alike
            positions = positions.clone()  # a new tensor each call, as each forward has
            module(x[:, : positions.shape[1]], positions)
            sync()
            start = time.perf_counter()
            module(x[:, : positions.shape[1]], positions.clone())
            sync()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(v) for name, v in times.items()}
    base = medians["default"]
    print(
        f"rotary cos/sin, packed row of {args.seq} tokens, h_d {args.head_dim}, threshold "
        f"{args.threshold}: "
        + " | ".join(f"{n} {s * 1e3:.3f} ms ({s / base:.2f}x)" for n, s in medians.items())
        + f"  (median of {args.repeats}, {args.threads} threads, {args.device})"
    )


if __name__ == "__main__":
    main()
