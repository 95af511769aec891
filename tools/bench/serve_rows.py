"""Rows served to the data loader: tokens per second of ``packed[i]`` in one process.

Packs ``N`` synthetic tokenized dialogues (those of ``pack_dataset.py``) with xtuner-rope's
``pack_dataset`` (whole dialogues) and with XTuner's, then reads ``--reads`` random rows of
each through ``__getitem__``, as a data loader worker does (XTuner's ``DefaultSampler`` order
is random), and prints the tokens per second of each and their ratio (ours / XTuner's),
measured in this one process.

Usage:
    python tools/bench/serve_rows.py [--dialogues 100000] [--reads 2000]
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from pack_dataset import make_dataset


def tokens_per_second(dataset, reads: int, seed: int = 0) -> float:
    """Tokens of ``reads`` random rows of ``dataset`` read by index, per second."""
    order = np.random.default_rng(seed).integers(0, len(dataset), reads).tolist()
    dataset[order[0]]  # first read maps the file
    start, tokens = time.perf_counter(), 0
    for i in order:
        tokens += len(dataset[i]["input_ids"])
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialogues", type=int, default=100_000)
    parser.add_argument("--reads", type=int, default=2_000)
    args = parser.parse_args()
    from datasets import Dataset
    from xtuner.dataset.huggingface import pack_dataset as xtuner_pack

    from xtuner_rope.data.packed_dataset import pack_dataset as ours_pack

    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        path = Path(tmp) / "tokenized.arrow"
        make_dataset(args.dialogues, path)
        rates = {}
        for which, pack in (("xtuner", xtuner_pack), ("ours", ours_pack)):
            packed = pack(Dataset.from_file(str(path)), 2048, True, True, 4)
            rates[which] = tokens_per_second(packed, args.reads)
            print(f"{which}: {len(packed)} rows, {rates[which] / 1e6:.2f}M tokens/s")
    print(f"rows served ours/XTuner {rates['ours'] / rates['xtuner']:.2f}x")


if __name__ == "__main__":
    main()
