"""Offline packing benchmark: xtuner-rope's lossless ``pack_dataset`` against XTuner's own.

On ``N`` synthetic short dialogues (token ids drawn at random, lengths of the sample
dialogues' spread: 8-200 tokens, prompt labels -100), tokenized as XTuner's ``tokenize_dataset``
leaves them (an Arrow dataset on disk, memory-mapped), both pack steps run with the stock
alpaca config's arguments (``max_length`` 2048, ``use_varlen_attn`` as the start-up sets it,
``shuffle_before_pack``, ``map_num_proc`` 32), each in a fresh process. Printed, from one
run: wall time of each and their ratio (ours / XTuner's), peak RSS of each process and of its
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


def make_dataset(n: int, folder: Path, seed: int = 0) -> int:
    """Write ``n`` tokenized synthetic dialogues to ``folder`` (``save_to_disk``); Arrow bytes."""
    import pyarrow as pa
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 201, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(3, 92_000, offsets[-1])
    prompt = (lengths * rng.uniform(0.2, 0.8, n)).astype(np.int64)  # labels -100 on the prompt
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    labels = np.where(position < np.repeat(prompt, lengths), -100, ids)
    table = pa.table({k: pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(v))
                      for k, v in (("input_ids", ids), ("labels", labels))})
    Dataset(table).save_to_disk(str(folder))
    return table.nbytes


def run_one(which: str, folder: str, num_proc: int) -> dict:
    """Pack the dataset in ``folder`` with ``which`` ('xtuner' or 'ours'); figures as a dict."""
    from datasets import load_from_disk

    import xtuner_rope  # noqa: F401  (as in training: the plugin is loaded)
    from xtuner.dataset.huggingface import pack_dataset as xtuner_pack
    from xtuner_rope.packed_dataset import pack_dataset as ours_pack

    dataset = load_from_disk(folder)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    packed = (xtuner_pack if which == "xtuner" else ours_pack)(dataset, 2048, True, True,
                                                               num_proc)
    seconds = time.perf_counter() - start
    peak, workers = (resource.getrusage(who).ru_maxrss / 1024
                     for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    table = packed.with_format("arrow")[:]
    import pyarrow.compute as pc

    labels = pc.list_flatten(table.column("labels"))
    return {"seconds": seconds, "rows": len(packed),
            "tokens": len(pc.list_flatten(table.column("input_ids"))),
            "labels": int(pc.sum(pc.not_equal(labels, -100)).as_py()),
            "rss_before_mib": rss_before / 1024,
            "peak_rss_mib": peak, "worker_peak_rss_mib": workers}


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
        folder = Path(tmp) / "tokenized"
        nbytes = make_dataset(args.dialogues, folder)
        print(f"{args.dialogues} dialogues, tokenized Arrow size {nbytes / 2**20:.0f} MiB")
        results = {}
        for which in ("xtuner", "ours"):
            out = subprocess.run([sys.executable, __file__, "--num-proc", str(args.num_proc),
                                  "--child", which, str(folder)],
                                 check=True, capture_output=True, text=True)
            results[which] = json.loads(out.stdout.strip().splitlines()[-1])
            print(which, json.dumps({k: round(v, 1) for k, v in results[which].items()}))
    x, o = results["xtuner"], results["ours"]
    print(f"time ours/XTuner {o['seconds'] / x['seconds']:.2f}x; peak RSS ours "
          f"{o['peak_rss_mib']:.0f} MiB (workers {o['worker_peak_rss_mib']:.0f}) vs XTuner "
          f"{x['peak_rss_mib']:.0f} MiB (workers {x['worker_peak_rss_mib']:.0f}); tokenized "
          f"{nbytes / 2**20:.0f} MiB; tokens kept ours {o['tokens']} / XTuner {x['tokens']}, "
          f"labels ours {o['labels']} / XTuner {x['labels']}")


if __name__ == "__main__":
    main()
