"""Offline packing benchmark: xtuner-rope's ``pack_dataset`` (each dialogue whole, nothing
dropped) against XTuner's own (cut every ``max_length`` tokens, shard leftovers dropped).

On ``N`` synthetic short dialogues (random token ids, 8-100 tokens, prompt labels -100),
tokenized as XTuner's ``tokenize_dataset`` leaves them (an Arrow cache file, memory-mapped),
both pack steps run with the stock alpaca config's arguments (``max_length`` 2048,
``use_varlen_attn`` as the start-up sets it, ``shuffle_before_pack``, ``map_num_proc`` 32),
each in a fresh process. Printed, from one
run: wall time and CPU time (the process and its map workers: a fairer figure on a shared
machine) of each and their ratios (ours / XTuner's), peak RSS of each process and of its
biggest map worker, the tokenized dataset's Arrow size, and the tokens and supervised labels
each keeps.

``--ranks 2`` builds the data as ``torchrun --nproc_per_node 2`` does instead: two processes
joined by gloo each call XTuner's ``process_hf_dataset`` / ours (``lossless_process_hf_dataset``)
on the tokenized dialogues (``do_dataset_tokenization=False``: XTuner's filter, pack step and
``length`` map), where rank 0 builds and the others receive its dataset by
``broadcast_object_list``. Printed per process: build time, peak RSS over its imports (and its
map workers'), whether its dataset is memory-mapped from files (not a private in-memory copy),
and a digest of its rows; then the peak RSS in all and whether both ranks hold the same rows.

Usage:
    python tools/bench/pack_dataset.py [--dialogues 1000000] [--mix alpaca|multiturn]
        [--num-proc 32] [--ranks 2]
"""

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _alpaca_like(rng, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[n]`` lengths of 8-100 tokens, ``[t]`` token ids and ``[t]`` prompt flags (the first
    20-80% of each dialogue); drawn in the order of the bench's first version (same data)."""
    lengths = rng.integers(8, 101, n)
    ids = rng.integers(3, 92_000, int(lengths.sum()))
    prompt = np.repeat((lengths * rng.uniform(0.2, 0.8, n)).astype(int), lengths)
    in_dialogue = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return lengths, ids, in_dialogue < prompt


def _multi_turn(rng, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[n]`` lengths, ``[t]`` token ids and ``[t]`` prompt flags of multi-turn dialogues.

    1-10 turns (1 + a geometric count, mean 2.5), each 16-256 tokens (a prompt of 20-80%,
    then its answer), the dialogue cut at 2,048 tokens as XTuner's tokenize step cuts it:
    mean about 340 tokens.
    """
    turns = np.minimum(rng.geometric(0.4, n), 10)
    turn_lengths = rng.integers(16, 257, int(turns.sum()))
    prompts = (turn_lengths * rng.uniform(0.2, 0.8, len(turn_lengths))).astype(int)
    token_turn = np.repeat(np.arange(len(turn_lengths)), turn_lengths)
    in_turn = np.arange(len(token_turn)) - np.repeat(
        np.cumsum(turn_lengths) - turn_lengths, turn_lengths
    )
    is_prompt = in_turn < prompts[token_turn]
    full = np.add.reduceat(turn_lengths, np.cumsum(turns) - turns)
    keep = np.arange(len(token_turn)) - np.repeat(np.cumsum(full) - full, full) < 2048
    lengths = np.minimum(full, 2048)
    return lengths, rng.integers(3, 92_000, int(lengths.sum())), is_prompt[keep]


def make_dataset(
    n: int, path: Path, seed: int = 0, chunk: int = 50_000, mix: str = "alpaca"
) -> int:
    """Write ``n`` tokenized synthetic dialogues to the Arrow file ``path``; its bytes.

    ``mix`` "alpaca": lengths 8-100 tokens (mean 54: the stock alpaca config's 2,400 sample
    dialogues average 52), labels -100 on a random prompt share of each dialogue;
    "multiturn": ``_multi_turn``'s dialogues up to 2,048 tokens, each turn's prompt -100.
    Written ``chunk`` dialogues at a time, as ``datasets.map`` writes a cache file.
    """
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter

    rng = np.random.default_rng(seed)
    with ArrowWriter(path=str(path)) as writer:
        for first in range(0, n, chunk):
            count = min(chunk, n - first)
            draw = _alpaca_like if mix == "alpaca" else _multi_turn
            lengths, ids, is_prompt = draw(rng, count)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            labels = np.where(is_prompt, -100, ids)
            writer.write_table(
                pa.table(
                    {
                        k: pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(v))
                        for k, v in (("input_ids", ids), ("labels", labels))
                    }
                )
            )
        writer.finalize()
    return path.stat().st_size


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (map workers)."""
    return sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def run_one(which: str, folder: str, num_proc: int) -> dict:
    """Pack the dataset in ``folder`` with ``which`` ('xtuner' or 'ours'); figures as a dict."""
    import pyarrow.compute as pc
    from datasets import Dataset
    from xtuner.dataset.huggingface import pack_dataset as xtuner_pack

    from xtuner_rope.data.packed_dataset import pack_dataset as ours_pack

    dataset = Dataset.from_file(folder)  # memory-mapped, as XTuner's tokenized cache
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu_before = _cpu_seconds()
    start = time.perf_counter()
    packed = (xtuner_pack if which == "xtuner" else ours_pack)(dataset, 2048, True, True, num_proc)
    seconds = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu_before
    peak, workers = (
        resource.getrusage(who).ru_maxrss / 1024
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    table = packed.with_format("arrow")[:]
    labels = pc.list_flatten(table.column("labels"))
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "rows": len(packed),
        "tokens": len(pc.list_flatten(table.column("input_ids"))),
        "labels": int(pc.sum(pc.not_equal(labels, -100)).as_py()),
        "rss_before_mib": rss_before / 1024,
        "peak_rss_mib": peak,
        "worker_peak_rss_mib": workers,
    }


def run_rank(which: str, folder: str, num_proc: int) -> dict:
    """One rank of a ``torchrun``-like build (``RANK``/``WORLD_SIZE`` set): figures as a dict."""
    import pyarrow.compute as pc
    import torch.distributed as dist
    from datasets import Dataset
    from xtuner.dataset.huggingface import process_hf_dataset

    from xtuner_rope.data.packed_dataset import lossless_process_hf_dataset

    dist.init_process_group("gloo")
    build = process_hf_dataset if which == "xtuner" else lossless_process_hf_dataset
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    packed = build(
        Dataset.from_file(folder),
        tokenizer=None,
        max_length=2048,
        do_dataset_tokenization=False,
        pack_to_max_length=True,
        use_varlen_attn=True,
        shuffle_before_pack=True,
        map_num_proc=num_proc,
    )
    seconds = time.perf_counter() - start
    peak, workers = (
        resource.getrusage(who).ru_maxrss / 1024
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    digest = hashlib.sha256()
    table = packed.with_format("arrow")[:]
    for column in ("input_ids", "labels", "cumulative_len"):
        values = pc.list_flatten(table.column(column)).to_numpy(zero_copy_only=False)
        digest.update(values.astype("int64").tobytes())
    dist.destroy_process_group()
    return {
        "rank": int(os.environ["RANK"]),
        "seconds": seconds,
        "rows": len(packed),
        "rss_before_mib": rss_before,
        "peak_rss_mib": peak,
        "worker_peak_rss_mib": workers,
        "memory_mapped": bool(packed.cache_files) and type(packed.data).__name__ != "InMemoryTable",
        "rows_sha256": digest.hexdigest()[:16],
    }


def run_ranks(which: str, folder: Path, num_proc: int, ranks: int) -> list[dict]:
    """``ranks`` processes building with ``which``, as ``torchrun`` starts them; their figures."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 500)}
    env["WORLD_SIZE"] = str(ranks)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--num-proc",
                str(num_proc),
                "--rank-child",
                which,
                str(folder),
            ],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    outs = [p.communicate() for p in procs]
    for p, (_out, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"rank failed ({p.returncode}):\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def main_ranks(args, folder: Path) -> None:
    """Print the ``--ranks`` figures of XTuner's build and ours."""
    for which in ("xtuner", "ours"):
        results = run_ranks(which, folder, args.num_proc, args.ranks)
        for r in results:
            print(
                which,
                json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}),
            )
        grown = " + ".join(f"{r['peak_rss_mib'] - r['rss_before_mib']:.0f}" for r in results)
        workers = " / ".join(f"{r['worker_peak_rss_mib']:.0f}" for r in results)
        total = sum(r["peak_rss_mib"] for r in results)
        same = len({r["rows_sha256"] for r in results}) == 1
        print(
            f"{which}: {args.ranks} processes, peak RSS in all {total:.0f} MiB (over the "
            f"imports: {grown} MiB; map workers {workers} MiB); every rank memory-mapped: "
            f"{all(r['memory_mapped'] for r in results)}; same rows on every "
            f"rank: {same}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialogues", type=int, default=1_000_000)
    parser.add_argument("--num-proc", type=int, default=32)
    parser.add_argument(
        "--mix",
        choices=("alpaca", "multiturn"),
        default="alpaca",
        help="dialogue lengths: 8-100 tokens, or multi-turn up to 2,048 (mean ~340)",
    )
    parser.add_argument("--ranks", type=int, default=0, help="build as N torchrun processes")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # which, folder
    parser.add_argument("--rank-child", nargs=2, help=argparse.SUPPRESS)  # which, folder
    args = parser.parse_args()
    if args.rank_child:
        print(json.dumps(run_rank(args.rank_child[0], args.rank_child[1], args.num_proc)))
        return
    if args.child:
        print(json.dumps(run_one(args.child[0], args.child[1], args.num_proc)))
        return
    with tempfile.TemporaryDirectory(prefix="pack-bench-") as tmp:
        folder = Path(tmp) / "tokenized.arrow"
        nbytes = make_dataset(args.dialogues, folder, mix=args.mix)
        print(
            f"{args.dialogues} dialogues ({args.mix}), tokenized Arrow size "
            f"{nbytes / 2**20:.0f} MiB"
        )
        if args.ranks:
            main_ranks(args, folder)
            return
        results = {}
        for which in ("xtuner", "ours"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--num-proc",
                    str(args.num_proc),
                    "--child",
                    which,
                    str(folder),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            results[which] = json.loads(out.stdout.strip().splitlines()[-1])
            print(which, json.dumps({k: round(v, 1) for k, v in results[which].items()}))
    x, o = results["xtuner"], results["ours"]
    print(
        f"time ours/XTuner {o['seconds'] / x['seconds']:.2f}x (CPU time "
        f"{o['cpu_seconds'] / x['cpu_seconds']:.2f}x); peak RSS ours "
        f"{o['peak_rss_mib']:.0f} MiB (workers {o['worker_peak_rss_mib']:.0f}) vs XTuner "
        f"{x['peak_rss_mib']:.0f} MiB (workers {x['worker_peak_rss_mib']:.0f}); tokenized "
        f"{nbytes / 2**20:.0f} MiB; tokens kept ours {o['tokens']} / XTuner {x['tokens']}, "
        f"labels ours {o['labels']} / XTuner {x['labels']}"
    )


if __name__ == "__main__":
    main()
