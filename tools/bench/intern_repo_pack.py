"""Intern-repo tokenized loader benchmark: xtuner-rope's ``build_whole_packed_dataset`` (each
document whole) against XTuner's ``build_packed_dataset`` (cut every ``packed_length`` tokens).

Writes ``N`` synthetic tokenized documents (8-100 tokens, a random prompt share unsupervised,
as negative ids: the intern-repo format) to one ``.bin`` file with its ``.meta`` index, as
XTuner's ``load_intern_repo_tokenized_dataset`` reads them (memory-mapped, one JSON line a
document); with ``--loader processed``, the untokenized loader's saved form instead
(``load_intern_repo_untokenized_dataset(processed_dataset_dict_path=...)``: a ``DatasetDict``
on disk, memory-mapped by ``load_from_disk``; the dialogues of ``pack_dataset.py``). Each builder runs in a fresh process on the stock intern-repo arguments
(``packed_length`` 8192, seed 1024), then serves random rows through ``__getitem__`` as a
data loader worker does (``--reads`` of XTuner's, whose rows cost 0.1-0.2 s each at 1M;
``--reads-ours`` of ours). Printed, from one run: build wall time, peak RSS over the imports
(build, then build + served rows), rows served per second in tokens, and the ratios ours /
XTuner's. ``--before DIR`` runs ours a second time from an older copy of the package
(``git archive <commit> xtuner_rope | tar -x -C DIR``) in the same run, and checks that both
serve the same rows (a digest of the first ``--reads`` rows read: every column, in order).

Usage:
    python tools/bench/intern_repo_pack.py [--documents 1000000] [--reads 200]
        [--reads-ours 2000] [--before DIR] [--loader tokenized|processed]
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


def make_corpus(n: int, folder: Path, seed: int = 0, chunk: int = 100_000) -> int:
    """Write ``n`` tokenized documents as ``folder/corpus.bin`` + ``.meta``; the file's bytes."""
    rng = np.random.default_rng(seed)
    path = folder / "corpus.bin"
    offsets, lengths, at = [], [], 0
    with open(path, "wb") as out:
        for first in range(0, n, chunk):
            sizes = rng.integers(8, 101, min(chunk, n - first))
            for size in sizes.tolist():
                ids = rng.integers(3, 92_000, size)
                ids[: int(size * rng.uniform(0.2, 0.8))] *= -1  # prompt: label -100
                line = (json.dumps({"tokens": ids.tolist()}) + "\n").encode()
                offsets.append(at)
                lengths.append(size)
                out.write(line)
                at += len(line)
    with open(f"{path}.meta", "wb") as meta:
        np.save(meta, np.stack([np.array(offsets), np.array(lengths)], axis=1))
    return path.stat().st_size


def make_processed(n: int, folder: Path) -> int:
    """Write ``n`` tokenized dialogues as the untokenized loader's saved ``DatasetDict``."""
    from datasets import Dataset, DatasetDict
    from pack_dataset import make_dataset

    make_dataset(n, folder / "tokenized.arrow")
    DatasetDict({"0": Dataset.from_file(str(folder / "tokenized.arrow"))}).save_to_disk(
        str(folder / "processed")
    )
    (folder / "tokenized.arrow").unlink()
    return sum(f.stat().st_size for f in (folder / "processed").rglob("*.arrow"))


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rows_digest(packed, order: list[int]) -> str:
    """A digest of rows ``order`` of ``packed``: every column's values, in order."""
    digest = hashlib.sha256()
    for i in order:
        row = packed[i]
        for key in ("input_ids", "labels", "cumulative_len", "position_ids"):
            digest.update(key.encode() + np.asarray(row[key], dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def run_one(which: str, folder: str, reads: int, digest_reads: int) -> dict:
    """Build the packed dataset of ``folder`` with ``which`` ('xtuner' or 'ours'); figures
    (ours also the digest of its first ``digest_reads`` rows read)."""
    from xtuner.dataset import intern_repo

    from xtuner_rope.data.intern_repo_packing import build_whole_packed_dataset

    build = intern_repo.build_packed_dataset if which == "xtuner" else build_whole_packed_dataset
    processed = Path(folder) / "processed"
    if processed.exists():
        load = intern_repo.load_intern_repo_untokenized_dataset
        cfg = dict(type=load, processed_dataset_dict_path=str(processed))
    else:
        cfg = dict(type=intern_repo.load_intern_repo_tokenized_dataset, folder=folder)
    before = _peak_mib()
    start = time.perf_counter()
    packed = build(cfg, packed_length=8192, seed=1024)
    seconds = time.perf_counter() - start
    built = _peak_mib()
    order = np.random.default_rng(0).integers(0, len(packed), reads).tolist()
    packed[order[0]]  # the first read opens the files (and, ours, the table's views)
    start, tokens = time.perf_counter(), 0
    for i in order:
        tokens += len(packed[i]["input_ids"])
    rate = tokens / (time.perf_counter() - start)
    digest = rows_digest(packed, order[:digest_reads]) if which == "ours" else None
    return {
        "digest": digest,
        "seconds": seconds,
        "rows": len(packed),
        "rss_before_mib": before,
        "build_peak_rss_mib": built,
        "served_peak_rss_mib": _peak_mib(),
        "served_mtokens_per_s": rate / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=200)  # XTuner's rows: ~0.2 s each at 1M
    parser.add_argument("--reads-ours", type=int, default=2000)  # ~1 ms each
    parser.add_argument("--before", help="an older xtuner_rope's parent folder, run as ours too")
    parser.add_argument("--loader", choices=("tokenized", "processed"), default="tokenized")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # which, folder
    args = parser.parse_args()
    if args.child:
        reads = args.reads if args.child[0] == "xtuner" else args.reads_ours
        print(json.dumps(run_one(args.child[0], args.child[1], reads, args.reads)))
        return
    with tempfile.TemporaryDirectory(prefix="intern-repo-bench-") as tmp:
        make = make_corpus if args.loader == "tokenized" else make_processed
        nbytes = make(args.documents, Path(tmp))
        print(f"{args.documents} documents, {args.loader} files {nbytes / 2**20:.0f} MiB")
        results = {}
        runs = [("xtuner", "xtuner", None), ("ours", "ours", None)]
        if args.before:
            runs.append(("ours-before", "ours", args.before))
        for label, which, path in runs:
            command = [sys.executable, __file__, "--reads", str(args.reads), "--reads-ours"]
            command += [str(args.reads_ours), "--child", which, tmp]
            env = {**os.environ, "PYTHONPATH": path} if path else None
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            results[label] = json.loads(out.stdout.strip().splitlines()[-1])
            shown = {
                k: v if isinstance(v, str) or v is None else round(v, 1)
                for k, v in results[label].items()
            }
            print(label, json.dumps(shown))
    x, o = results["xtuner"], results["ours"]
    if args.before:
        b = results["ours-before"]
        print(
            f"ours now/before: build time {o['seconds'] / b['seconds']:.2f}x, peak RSS over the "
            f"imports {(o['build_peak_rss_mib'] - o['rss_before_mib']):.0f} / "
            f"{(b['build_peak_rss_mib'] - b['rss_before_mib']):.0f} MiB at build, "
            f"{(o['served_peak_rss_mib'] - o['rss_before_mib']):.0f} / "
            f"{(b['served_peak_rss_mib'] - b['rss_before_mib']):.0f} MiB with rows served; rows "
            f"served {o['served_mtokens_per_s'] / b['served_mtokens_per_s']:.2f}x; the same "
            f"{args.reads} rows: {o['digest'] == b['digest']}"
        )

    def grown(r, key):
        return r[key] - r["rss_before_mib"]

    print(
        f"build time ours/XTuner {o['seconds'] / x['seconds']:.2f}x; peak RSS ours/XTuner "
        f"{o['build_peak_rss_mib'] / x['build_peak_rss_mib']:.2f}x at build (over the imports: "
        f"ours {grown(o, 'build_peak_rss_mib'):.0f} MiB, XTuner "
        f"{grown(x, 'build_peak_rss_mib'):.0f}), {o['served_peak_rss_mib'] / x['served_peak_rss_mib']:.2f}x "
        f"with rows served; rows ours {o['rows']} / XTuner {x['rows']}; rows served ours/XTuner "
        f"{o['served_mtokens_per_s'] / x['served_mtokens_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
