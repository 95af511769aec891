"""Packed attention fwd+bwd on short-dialogue packs: our backends against the kernels alone.

One packed row of ``t`` tokens made of short documents (lengths drawn uniformly from
``[1, --max-doc]``, seeded; the last one cut to fit), q ``[1, t, n_h, h_d]``, k/v
``[1, t, n_kv, h_d]`` (InternLM2-1.8B's 16/8 heads of 128 by default). Candidates, each one
forward + backward, timed in the same process and printed as ratios to ``varlen_attn`` alone
(to the bucketed SDPA path where that kernel cannot run, e.g. on CPU):

- ``varlen_attn``: torch's ``varlen_attn`` called directly (the floor of the ``varlen`` backend);
- ``ours-varlen``: ``packed_attention(..., 'varlen')``, layouts and GQA handling included;
- ``ours-buckets``: ``packed_attention(..., 'sdpa')``, documents re-padded into length buckets;
- ``dense-mask``: SDPA over the whole row with a ``[t, t]`` block-diagonal causal mask;
- ``flex``: ``flex_attention`` with a document block mask (compiled; compile time excluded).

The plan (``document_plan``) is built once per forward in a model, shared by all layers; its
cost is timed apart, on a line of its own, ``--repeats`` plans after ``--warmup``, each on a
fresh batch's tensors: on CUDA their mean, back to back between two CUDA events (device work
included, so a host sync inside the plan shows as the time it stalls); on the CPU the median of
single plans:
from host boundaries (``cumulative_len`` as the collate function leaves it: no device read, no
buckets, what the varlen backend gets) against the path without them (position ids read back
from the device, length buckets built: what every forward paid before issue 48 item 4).
Unavailable candidates print why.

Usage:
    python tools/bench/attention.py --device cuda --dtype bf16 --tokens 2048 8192 32768
    python tools/bench/attention.py --tokens 256 512 --heads 4 --kv-heads 2 --head-dim 32  # CPU
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_timing import seconds_per_call  # noqa: E402 - tools/bench/bench_timing.py

from xtuner_rope.ops.attention import packed_attention, plan_documents, varlen_kernel  # noqa: E402
from xtuner_rope.ops.document_plan import document_plan  # noqa: E402
from xtuner_rope.ops.packing import cumulative_from_lengths  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-doc", type=int, default=200, help="longest document (tokens)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-flex", action="store_true", help="skip flex attention")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def document_lengths(t, max_doc, seed):
    """Short documents filling exactly ``t`` tokens."""
    gen, lengths = torch.Generator().manual_seed(seed), []
    while sum(lengths) < t:
        lengths.append(int(torch.randint(1, max_doc + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - t
    return [n for n in lengths if n > 0]


def candidates(args, q, k, v, lengths, plan):
    """name -> callable returning the attention output ``[1, t, n_h, h_d]`` (or a reason)."""
    device, t = q.device, q.shape[1]
    runs = {}
    kernel = varlen_kernel()
    if kernel is not None and device.type in kernel.device_types:
        params = __import__("inspect").signature(kernel.fn).parameters
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        gqa = {"enable_gqa": True} if "enable_gqa" in params else None
        cu = plan.cu_seqlens

        def varlen_alone():
            kk, vv = (
                (k[0], v[0])
                if gqa is not None
                else (x[0].repeat_interleave(q.shape[2] // k.shape[2], dim=1) for x in (k, v))
            )
            return kernel.fn(
                q[0], kk, vv, cu, cu, plan.max_seqlen, plan.max_seqlen, **causal, **(gqa or {})
            )[None]

        runs["varlen_attn"] = varlen_alone
        runs["ours-varlen"] = lambda: packed_attention(q, k, v, plan, "varlen")
    else:
        runs["varlen_attn"] = f"unavailable on {device.type} (torch's kernel is CUDA-only)"
    runs["ours-buckets"] = lambda: packed_attention(q, k, v, plan, "sdpa")
    doc = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )  # [t] document id
    pos = torch.arange(t, device=device)

    def dense_mask():
        mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])  # [t, t]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2)

    runs["dense-mask"] = dense_mask
    runs["flex"] = "skipped (--no-flex)" if args.no_flex else flex_candidate(q, k, v, doc)
    return runs


def flex_candidate(q, k, v, doc):
    """flex_attention with a document-causal block mask, compiled; or why it cannot run."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        t = q.shape[1]
        block = create_block_mask(document_causal, None, None, t, t, device=q.device.type)
        flex = torch.compile(flex_attention, dynamic=False)

        def run():
            out = flex(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                block_mask=block,
                enable_gqa=True,
            )
            return out.transpose(1, 2)

        run()  # compile now, outside the timing
        return run
    except Exception as e:  # noqa: BLE001 - a bench reports what cannot run and goes on
        return f"unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def measure(args, runs, q, k, v):
    """Median seconds of one forward + backward per runnable candidate, interleaved."""
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    grad = torch.randn_like(q)

    def fwd_bwd(run):
        out = run()
        torch.autograd.grad(out, (q, k, v), grad)

    ok = {name: run for name, run in runs.items() if callable(run)}
    for _ in range(args.warmup):
        for run in ok.values():
            fwd_bwd(run)
    times = {name: [] for name in ok}
    for _ in range(args.repeats):
        for name, run in ok.items():
            sync()
            start = time.perf_counter()
            fwd_bwd(run)
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_one(args, t):
    """One line: the ratios of every candidate at ``t`` tokens."""
    torch.manual_seed(args.seed)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    q, k, v = (
        torch.randn(1, t, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
        for n in (args.heads, args.kv_heads, args.kv_heads)
    )
    lengths = document_lengths(t, args.max_doc, args.seed)
    plan = plan_documents(cumulative_from_lengths(lengths), device)
    runs = candidates(args, q, k, v, lengths, plan)
    seconds = measure(args, runs, q, k, v)
    base = "varlen_attn" if "varlen_attn" in seconds else "ours-buckets"
    parts = [
        f"{name} {seconds[name] / seconds[base]:.2f}x" if name in seconds else f"{name} {run}"
        for name, run in runs.items()
    ]
    print(
        f"attention fwd+bwd t={t} ({len(lengths)} docs, max {plan.max_seqlen}) {args.dtype} "
        f"{args.device}: "
        + " | ".join(parts)
        + f"  [{base} {seconds[base] * 1e3:.2f} ms, median of {args.repeats}]"
    )
    plan_line(args, lengths, device)
    return seconds


def plan_line(args, lengths, device):
    """One line: the plan's time per forward, from host boundaries against position ids."""
    t, n = sum(lengths), args.warmup + args.repeats
    cu = cumulative_from_lengths(lengths)
    positions = torch.cat([torch.arange(d) for d in lengths])[None].to(device)  # [1, t]
    # A fresh tensor per forward, as a new batch brings: the plan cache must miss every time.
    host_cus = [cu.clone() for _ in range(n)]
    device_positions = [positions.clone() for _ in range(n)]

    def from_host(i):
        return document_plan(device_positions[i], 1, t, device, published=host_cus[i])

    def from_positions(i):
        return document_plan(device_positions[i], 1, t, device).buckets

    per_call, cuda = [], device.type == "cuda"
    for fn in (from_host, from_positions):
        for i in range(args.warmup):
            fn(i)
        batches = iter(range(args.warmup, n))
        call = lambda fn=fn, batches=batches: fn(next(batches))  # noqa: E731 - one batch each
        if cuda:  # the mean of back-to-back plans, device work included
            per_call.append(seconds_per_call(call, args.repeats, device))
        else:  # the median of single plans: robust to other jobs on a shared CPU
            times = [seconds_per_call(call, 1, device) for _ in range(args.repeats)]
            per_call.append(statistics.median(times))
    host, old = per_call
    how = "mean of {} back to back (CUDA events)" if cuda else "median of {}"
    print(
        f"plan per forward t={t} ({len(lengths)} docs) {args.device}: host boundaries "
        f"{host * 1e3:.3f} ms | from position ids + buckets {old * 1e3:.3f} ms "
        f"({old / host:.1f}x the host path), {how.format(args.repeats)}"
    )


def main(argv=None):
    args = parse_args(argv)
    return {t: bench_one(args, t) for t in args.tokens}


if __name__ == "__main__":
    main()
