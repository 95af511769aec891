"""Time RoPE apply: xtuner_rope against the HF-style eager apply of XTuner's InternLM2.

Times are medians over interleaved repeats, printed as ratios to cloning q and k (the memory
traffic floor of any out-of-place apply), for example:

    rope apply fp32 q[1,16,2048,128] k[1,8,2048,128]: clone 1.00x | hf-eager 12.1x | ...

On CUDA each repeat times `--calls` calls back to back between two CUDA events (`bench_timing`):
the device's time per call, not the host's launch path that a synchronised single call measures
(the 2026-11-27 H100 figures were taken that way: launch-bound at 4k tokens). Use shapes of 4k
to 64k tokens (`--seq 4096 65536`). Every candidate meant to run the Triton kernel is checked:
its check against HF's fp32 apply must pass and `triton_kernel_calls()` must count its launches
(forward and backward), in the check and in every timed call; one that fell back to the eager
kernel or computes wrongly is printed as FAILED, not timed, and the bench exits 1 at the end.

`xtuner_rope` is the package's apply with its default kernel for the device (CPU: the eager
kernel; CUDA: the Triton kernel), `xtuner_rope-fused` the opt-in torch.compile one
(`ValidatedRoPEHook(fused_apply=True)`; its compile happens during the warm-up runs). On CUDA
`xtuner_rope-eager` (`use_triton_apply(False)`) and `xtuner_rope-triton` are timed apart, after
the Triton kernel's forward and backward are checked against HF's apply in fp32 (the bench
stops with exit code 1 if they differ beyond the dtype's tolerance). `liger` is Liger-Kernel's
Triton RoPE (`LigerRopeFunction`, the peer issue 48 measures against), where `liger_kernel`
imports and Triton runs (CUDA, or the CPU under `TRITON_INTERPRET=1`): checked against HF's fp32
apply first (no further from it than HF's own apply in the dtype, within 2x), and left out of the
timing (not fatal) if it fails or does not import. Under Triton's CPU interpreter Liger gives NaN in bf16 (the
interpreter's bf16 arithmetic; the package's kernel computes in fp32 and is exact there).

Usage:
    python tools/bench/rope.py --dtype fp32 --repeats 50 --threads 2 [--backward] [--no-fused]
    python tools/bench/rope.py --device cuda --dtype bf16 --seq 4096 --repeats 100  # on a GPU
    python tools/bench/rope.py --device cuda --dtype bf16 --seq 4096 65536 --no-fused --both \
        --sweep  # the kit's
    TRITON_INTERPRET=1 XTUNER_ROPE_TRITON_INTERPRET=1 python tools/bench/rope.py --seq 64 \
        --heads 4 --kv-heads 2 --head-dim 32 --no-fused --both --repeats 2  # Triton kernels on CPU

On a shared machine wall-clock ratios swing with other jobs: `--stat min` keeps each
candidate's fastest run, and `--clock cpu --threads 1` measures this process's CPU time.
"""

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from xtuner._lite.modelings.internlm2.modeling_internlm2 import (
    apply_rotary_pos_emb as hf_apply_rotary_pos_emb,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_timing import seconds_per_call  # noqa: E402 - tools/bench/bench_timing.py

from xtuner_rope.models.internlm2_rope import ValidatedRotaryEmbedding  # noqa: E402
from xtuner_rope.ops import rope_triton  # noqa: E402
from xtuner_rope.ops.rope import (  # noqa: E402
    apply_rotary_pos_emb,
    use_fused_apply,
    use_triton_apply,
)
from xtuner_rope.ops.rope_triton import triton_apply_active, triton_kernel_calls  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# --sweep: the families' attention shapes at --seq tokens (batch, heads, kv heads, head dim,
# q/k as transposed views of [b, s, n, h_d] as InternLM2 passes them), one line each.
SWEEP = {
    "internlm2-1.8b": (1, 16, 8, 128, False),
    "internlm2-1.8b-views": (1, 16, 8, 128, True),
    "llama3-8b": (1, 32, 8, 128, False),
    "qwen2.5-0.5b": (1, 14, 2, 64, False),
    "phi3-mini": (1, 32, 32, 96, False),
    "internlm2-7b-batch4": (4, 32, 8, 128, False),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument(
        "--seq", type=int, nargs="+", default=[2048], help="tokens per call, one run each"
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--calls",
        type=int,
        default=10,
        help="CUDA: calls timed back to back between two events per repeat (CPU: 1)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--transposed",
        action="store_true",
        help="q/k as transposed views of [b, s, n, h_d], as InternLM2 passes them",
    )
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument(
        "--tiles",
        type=int,
        nargs="*",
        default=[],
        help="also time the Triton kernel at these tile sizes (q elements per program; the "
        "package's is ops.rope_triton._TILE): one candidate each, to choose it on a GPU",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help=f"every shape of {', '.join(SWEEP)} at --seq tokens (batch 4: --seq / 4 each)",
    )
    parser.add_argument(
        "--both", action="store_true", help="time forward, then forward + backward (one start-up)"
    )
    parser.add_argument(
        "--no-fused",
        action="store_true",
        help="skip the fused kernel (and its few seconds of compiling)",
    )
    parser.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="statistic over repeats (min resists other jobs on the machine)",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time (use with --threads 1 on a busy machine)",
    )
    args = parser.parse_args(argv)
    args.seqs, args.seq = args.seq, args.seq[0]  # every --seq; the one being measured
    return args


def liger_apply():
    """Liger-Kernel's RoPE as ``apply(q, k, cos, sin) -> (q, k)``; None where it cannot run.

    Liger rotates in place the ``[b, s, n, h_d]`` storage of q and k (a copy when they are
    ``[b, n, s, h_d]`` contiguous, the inputs themselves when they are transposed views): its
    output is the timed one, the inputs' values do not matter to the timing.
    """
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as error:  # noqa: BLE001 - a peer that does not import is skipped
        print(f"liger: skipped, it does not import ({type(error).__name__}: {error})"[:300])
        return None
    return LigerRopeFunction.apply


def make_inputs(args):
    """q `[b, n_h, s, h_d]`, k `[b, n_kv, s, h_d]`, cos/sin `[b, s, h_d]` and output grads."""
    dtype, device = DTYPES[args.dtype], torch.device(args.device)

    def heads(n):
        if args.transposed:  # [b, s, n, h_d] -> [b, n, s, h_d] view
            x = torch.randn(args.batch, args.seq, n, args.head_dim, dtype=dtype, device=device)
            return x.transpose(1, 2).requires_grad_(args.backward)
        x = torch.randn(args.batch, n, args.seq, args.head_dim, dtype=dtype, device=device)
        return x.requires_grad_(args.backward)

    q, k = heads(args.heads), heads(args.kv_heads)
    rotary = ValidatedRotaryEmbedding(
        args.head_dim, max_position_embeddings=args.seq, device=device
    )
    cos, sin = rotary(k, torch.arange(args.seq, device=device)[None].expand(args.batch, -1))
    grads = (torch.randn_like(q), torch.randn_like(k))
    return q, k, cos, sin, grads


def candidates(args, q, k, cos, sin, grads, liger=None):
    """name -> callable doing one forward (and backward with --backward)."""

    def clone():
        out = q.detach().clone(), k.detach().clone()
        if args.backward:  # the backward writes one more q- and k-sized tensor
            out = grads[0].clone(), grads[1].clone()
        return out

    def timed(apply, triton=None, tile=None, fused=False):
        def run():
            use_fused_apply(fused)
            use_triton_apply(triton)
            with triton_tile(tile):  # q elements per program, forward and backward
                q_out, k_out = apply(q, k, cos, sin)
                if args.backward:
                    torch.autograd.backward((q_out, k_out), grads)
            use_fused_apply(False)
            use_triton_apply(None)

        return run

    runs = {
        "clone": clone,
        "hf-eager": timed(hf_apply_rotary_pos_emb),
        "xtuner_rope": timed(apply_rotary_pos_emb),
    }
    if triton_apply_active(q):
        runs["xtuner_rope-eager"] = timed(apply_rotary_pos_emb, triton=False)
        runs["xtuner_rope-triton"] = timed(apply_rotary_pos_emb, triton=True)
        for tile in args.tiles:
            runs[f"xtuner_rope-triton-tile{tile}"] = timed(apply_rotary_pos_emb, True, tile)
    if not args.no_fused:
        runs["xtuner_rope-fused"] = timed(apply_rotary_pos_emb, fused=True, triton=False)
    if liger is not None:
        runs["liger"] = timed(liger)
    return runs


def kernel_runs(runs, q):
    """The candidates that must launch the Triton kernel on every call."""
    if not triton_apply_active(q):
        return set()
    return {name for name in runs if name == "xtuner_rope" or name.startswith("xtuner_rope-tri")}


def counted(run, launches, name, failed):
    """``run`` that records ``name`` in ``failed`` when it did not launch the kernel
    ``launches`` times (it fell back to the eager kernel)."""

    def wrapped():
        before = triton_kernel_calls()
        run()
        if triton_kernel_calls() != before + launches and name not in failed:
            failed[name] = f"fell back to the eager kernel ({triton_kernel_calls() - before} "
            failed[name] += f"of {launches} launches)"

    return wrapped


@contextlib.contextmanager
def triton_tile(tile):
    """The Triton kernel's tile (q elements per program) set to ``tile`` (None: unchanged)."""
    before = rope_triton._TILE
    rope_triton._TILE = tile or before
    try:
        yield
    finally:
        rope_triton._TILE = before


def check_against_hf(apply, q, k, cos, sin, grads):
    """How far ``apply``'s q, k and their grads are from HF's apply in fp32.

    Returns:
        tuple[float, list[float]]: the largest error beyond the dtype's tolerance (<= 1e-5:
        within it) and the max |error| of q, k, grad q, grad k.
    """
    # Clones: Liger rotates q, k and the output grads in place where their layout allows.
    q_in, k_in = (x.detach().clone().requires_grad_() for x in (q, k))
    q_out, k_out = apply(q_in, k_in, cos, sin)
    grads_in = tuple(g.clone() for g in grads)
    got = [q_out, k_out, *torch.autograd.grad((q_out, k_out), (q_in, k_in), grads_in)]
    q32, k32 = (x.detach().float().requires_grad_() for x in (q, k))
    q_ref, k_ref = hf_apply_rotary_pos_emb(q32, k32, cos.float(), sin.float())
    want = [q_ref, k_ref, *torch.autograd.grad((q_ref, k_ref), (q32, k32), grads)]
    # bf16/fp16 outputs round once: relative 2**-8 / 2**-11 of each element, plus a margin.
    rtol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[q.dtype]
    errors = [((g.float() - w).abs() - rtol * w.abs()).max().item() for g, w in zip(got, want)]
    return max(errors), [(g.float() - w).abs().max().item() for g, w in zip(got, want)]


def measure(args, runs, q, failed):
    """Seconds per call (median or min), or None for a candidate in ``failed`` (not timed, or
    found falling back to eager while timed); candidates interleaved so noise hits all alike.

    On CUDA each sample is ``--calls`` calls back to back between two CUDA events. On the CPU
    each timed call follows an untimed call of the same candidate: otherwise one candidate pays
    the page faults of memory that the allocator returned to the OS after the previous one.
    """
    cuda = args.device.startswith("cuda")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    kernel, order = kernel_runs(runs, q), list(runs)
    runs = {
        name: counted(run, 2 if args.backward else 1, name, failed) if name in kernel else run
        for name, run in runs.items()
        if name not in failed
    }
    for _ in range(args.warmup):
        for run in runs.values():
            run()
    times = {name: [] for name in runs}
    for _ in tqdm(range(args.repeats), desc="rope bench", leave=False, disable=None):
        for name, run in runs.items():
            if not cuda:
                run()
            times[name].append(seconds_per_call(run, args.calls if cuda else 1, args.device, clock))
    stat = statistics.median if args.stat == "median" else min
    return {name: None if name in failed else stat(times[name]) for name in order}


def triton_apply(q, k, cos, sin):
    """The package's apply with the Triton kernel forced on."""
    use_triton_apply(True)
    try:
        return apply_rotary_pos_emb(q, k, cos, sin)
    finally:
        use_triton_apply(None)


def checked(name, apply, q, k, cos, sin, grads, peer=False):
    """Print ``apply``'s check against HF's fp32 apply; True where it passed.

    The package's kernel must round once (the dtype's tolerance). A peer (``peer=True``) must
    be no further from fp32 than HF's own apply in the dtype, within 2x: Liger computes in the
    dtype of cos/sin, as HF's apply does.
    """
    excess, errors = check_against_hf(apply, q, k, cos, sin, grads)
    if peer:
        _, hf_errors = check_against_hf(hf_apply_rotary_pos_emb, q, k, cos, sin, grads)
        passed = all(e <= 2 * h + 1e-6 for e, h in zip(errors, hf_errors))
        bound = f" (HF's own apply in {q.dtype}: {max(hf_errors):.2e})"
    else:
        passed, bound = excess <= 1e-5, ""
    print(
        f"{name} vs HF's fp32 apply, {q.dtype} q{list(q.shape)}: "
        f"{'PASS' if passed else 'FAIL'}, max |error| q {errors[0]:.2e} k {errors[1]:.2e} "
        f"grad q {errors[2]:.2e} grad k {errors[3]:.2e}".replace(", ", ",").replace(",", ", ", 2)
        + bound
    )
    return passed


def report(args, q, k, medians, failed):
    floor = medians["clone"]
    what = "apply fwd+bwd" if args.backward else "apply"
    ratios = " | ".join(
        f"{name} FAILED ({failed[name]}, not timed)" if seconds is None
        else f"{name} {seconds / floor:.2f}x"
        for name, seconds in medians.items()
    )  # fmt: skip
    # Share of copy bandwidth (the clone's bytes/s): the GPU target is >= 75% for the forward.
    ratios += "".join(
        f" | {name} at {100 * floor / seconds:.0f}% of copy bandwidth"
        for name, seconds in medians.items()
        if seconds is not None
        and (name.endswith(("-fused", "-triton")) or "-tile" in name or name == "liger")
    )
    timing = f"{args.clock}, {args.threads} threads"
    if args.device.startswith("cuda"):
        timing = f"CUDA events over {args.calls} calls back to back"
    print(
        f"rope {what} {args.dtype} q{list(q.shape)} k{list(k.shape)}: {ratios}".replace(", ", ",")
        + f"  ({args.stat} of {args.repeats}, clone {floor * 1e3:.3f} ms, {timing})"
    )


def kernel_fault(name, q, k, cos, sin, grads):
    """Why the package's Triton kernel fails on these inputs (checked against HF's fp32
    apply, its launches counted), or None."""
    before = triton_kernel_calls()
    passed = checked(name, triton_apply, q, k, cos, sin, grads)
    launched = triton_kernel_calls() - before
    if launched != 2:
        print(f"{name}: FAILED, it fell back to the eager kernel ({launched} of 2 launches)")
        return f"fell back to the eager kernel ({launched} of 2 launches in its check)"
    return None if passed else "wrong against HF's fp32 apply"


# Rows marked FAILED in this process: the bench exits 1 if any.
FAILURES = []


def bench_shape(args, passes):
    """Check the Triton kernels on ``args``' shape, then time each pass; {backward: seconds}."""
    args.backward = True in passes  # the inputs need grads if any pass runs the backward
    q, k, cos, sin, grads = make_inputs(args)
    failed = {}  # candidate -> why it is not timed
    if triton_apply_active(q):
        for tile in [None, *args.tiles]:
            with triton_tile(tile):
                name = f"triton kernel (tile {rope_triton._TILE})" if tile else "triton kernel"
                why = kernel_fault(name, q, k, cos, sin, grads)
            if why is not None:
                failed[f"xtuner_rope-triton-tile{tile}" if tile else "xtuner_rope-triton"] = why
        if "xtuner_rope-triton" in failed:  # the default candidate runs the same kernel
            failed["xtuner_rope"] = failed["xtuner_rope-triton"]
    liger = liger_apply()
    if liger is not None and not checked("liger", liger, q, k, cos, sin, grads, peer=True):
        liger = None  # a peer's failure is reported, not fatal; it is not timed
    results = {}
    for backward in passes:
        args.backward = backward
        q_in, k_in = (q, k) if backward else (q.detach(), k.detach())  # forward: no graph
        runs = candidates(args, q_in, k_in, cos, sin, grads, liger)
        results[backward] = measure(args, runs, q, failed)
        report(args, q, k, results[backward], failed)
    FAILURES.extend(failed)
    return results


def bench_seq(args, passes):
    """One shape (or, with --sweep, every shape of SWEEP) at ``args.seq`` tokens per call."""
    if not args.sweep:
        return bench_shape(args, passes)
    seq, results = args.seq, {}
    for name, (batch, heads, kv_heads, head_dim, transposed) in SWEEP.items():
        print(f"== {name}")
        args.batch, args.heads, args.kv_heads, args.head_dim = batch, heads, kv_heads, head_dim
        args.seq, args.transposed = seq // batch, transposed  # the same tokens per call
        results[name] = bench_shape(args, passes)
    args.seq = seq
    return results


def main(argv=None):
    """Check the Triton kernels, then print one ratio line per pass (and shape and --seq).

    Returns:
        dict: {backward: {candidate: seconds, or None where FAILED}}; with --sweep, {shape
        name: that}; with several --seq, {seq: that}.
    """
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    passes = [False, True] if args.both else [args.backward]
    seqs, results = args.seqs, {}
    for seq in seqs:
        if len(seqs) > 1:
            print(f"==== {seq} tokens per call")
        args.seq = seq
        results[seq] = bench_seq(args, passes)
    return results[seqs[0]] if len(seqs) == 1 else results


if __name__ == "__main__":
    main()
    if FAILURES:
        print(f"rope bench: FAILED rows: {', '.join(sorted(set(FAILURES)))}")
        sys.exit(1)
