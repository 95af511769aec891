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

Usage:
    python tools/bench/pack_dataset.py [--dialogues 1000000] [--num-proc 32]
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_dataset(n: int, path: Path, seed: int = 0, chunk: int = 50_000) -> int:
    """Write ``n`` tokenized synthetic dialogues to the Arrow file ``path``; its bytes.

    Lengths 8-100 tokens (mean 54: the stock alpaca config's 2,400 sample dialogues average
    52); labels -100 on a random prompt share of each dialogue. Written ``chunk`` dialogues
    at a time, as ``datasets.map`` writes a cache file.
    """
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter

    rng = np.random.default_rng(seed)
    with ArrowWriter(path=str(path)) as writer:
        for first in range(0, n, chunk):
            lengths = rng.integers(8, 101, min(chunk, n - first))
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            ids = rng.integers(3, 92_000, offsets[-1])
            prompt = np.repeat((lengths * rng.uniform(0.2, 0.8, len(lengths))).astype(int), lengths)
            labels = np.where(
                np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths) < prompt, -100, ids
            )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialogues", type=int, default=1_000_000)
    parser.add_argument("--num-proc", type=int, default=32)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # which, folder
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child[0], args.child[1], args.num_proc)))
        return
    with tempfile.TemporaryDirectory(prefix="pack-bench-") as tmp:
        folder = Path(tmp) / "tokenized.arrow"
        nbytes = make_dataset(args.dialogues, folder)
        print(f"{args.dialogues} dialogues, tokenized Arrow size {nbytes / 2**20:.0f} MiB")
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
