"""The doctor at scale: ``xtuner-rope doctor`` against the training start-up's dataset build.

Writes ``N`` short synthetic dialogues (one user turn and one reply of random words from the
sample data; 18-114 tokens, mean 54, with the tiny tokenizer's template) as a user's ``jsonl``
data file, and a config derived from ``configs/tiny_internlm2_short_dialogues.py`` with
``pack_to_max_length=True`` reading it (the tiny InternLM2 tokenizer under ``models/``). A first
build (not timed) fills the datasets cache with the tokenized dialogues; then, each in a fresh
process and each from a **warm tokenized cache** (the packed rows that a build leaves beside it
removed first, so that both pack):

(a) the dataset build of ``xtuner train``'s start-up: ``Config.fromfile``, the config's
    ``model_resource`` (the plugin's start-up: ``lossless_process_hf_dataset``), numpy seeded
    from ``randomness.seed`` as MMEngine's Runner seeds it, ``BUILDER.build`` of the train
    dataset;
(b) ``xtuner-rope doctor`` on the same config (its command line, the report and the plot
    written).

Printed: wall time (the process, imports included), CPU time (the process and its workers),
peak RSS of the process and of its biggest worker, and the ratios doctor / build; with
``--progress`` the doctor's stderr is shown as it runs.

Usage (from the repository root):
    python tools/bench/doctor_scale.py [--dialogues 1000000] [--num-proc 1] [--keep DIR]
        [--progress] [--warm-only]

``--keep DIR`` keeps the data, the config and the datasets cache in ``DIR`` and reuses them
the next time (``--warm-only`` stops after filling the cache: tokenizing 1M dialogues took
834 s here).
"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_internlm2_short_dialogues.py"


def make_dialogues(n: int, path: Path, seed: int = 0) -> int:
    """Write ``n`` one-turn dialogues (``messages``) to ``path`` as json lines; its bytes.

    Words are drawn from the sample dialogues: 1-8 for the question, 1-16 for the reply (with
    the chat template, 18-114 tokens, 54 on average, like the pack bench's 8-100).
    """
    words = sorted(
        {
            w
            for line in (REPO / "data" / "short_dialogues.jsonl").open(encoding="utf-8")
            for m in json.loads(line)["messages"]
            for w in re.findall(r"[A-Za-z]+", m["content"])
        }
    )
    rng = np.random.default_rng(seed)
    vocab = np.asarray(words, dtype=object)
    with path.open("w", encoding="utf-8") as f:
        for first in range(0, n, 10_000):
            count = min(10_000, n - first)
            asks, replies = rng.integers(1, 9, count), rng.integers(1, 17, count)
            picked = vocab[rng.integers(0, len(vocab), int(asks.sum() + replies.sum()))]
            at = 0
            lines = []
            for a, r in zip(asks, replies):
                user = " ".join(picked[at : at + a]) + "?"
                reply = " ".join(picked[at + a : at + a + r]) + "."
                at += a + r
                lines.append(
                    json.dumps(
                        {
                            "messages": [
                                {"role": "user", "content": user},
                                {"role": "assistant", "content": reply},
                            ]
                        }
                    )
                )
            f.write("\n".join(lines) + "\n")
    return path.stat().st_size


def write_config(folder: Path, data: Path, num_proc: int) -> Path:
    """The tiny recipe packed offline, reading ``data``; its path."""
    text = TINY.read_text(encoding="utf-8")
    edits = {
        r'^data_path = ".*"$': f'data_path = "{data}"',
        r"^    pack_to_max_length=False,$": "    pack_to_max_length=True,",
        r"^    map_num_proc=1,$": f"    map_num_proc={num_proc},",
        r"^warmup_ratio = 0.03$": "warmup_ratio = 0.1",  # >= 1 iteration on small N too
    }
    for pattern, new in edits.items():
        text, count = re.subn(pattern, new, text, flags=re.M)
        assert count == 1, f"{pattern!r} matched {count} times in {TINY}"
    config = folder / "tiny_packed_scale.py"
    config.write_text(text, encoding="utf-8")
    return config


def _usage() -> dict:
    """Peak RSS (MiB) of this process and its biggest worker, CPU seconds of both."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return {
        "cpu_seconds": own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime,
        "peak_rss_mib": own.ru_maxrss / 1024,
        "worker_peak_rss_mib": kids.ru_maxrss / 1024,
    }


def child_build(config: str) -> dict:
    """(a): the train dataset as ``xtuner train``'s start-up builds it."""
    import xtuner_rope

    xtuner_rope.activate()
    from mmengine.config import Config
    from mmengine.runner import set_random_seed
    from xtuner.registry import BUILDER

    from xtuner_rope.config.as_xtuner_train import start

    cfg = start(Config.fromfile(config))
    set_random_seed((cfg.get("randomness") or {}).get("seed"))
    dataset = BUILDER.build(cfg.train_dataloader.dataset)
    return {"rows": len(dataset)}


def child_doctor(config: str, out: str) -> dict:
    """(b): ``xtuner-rope doctor CONFIG --out OUT``."""
    from xtuner_rope.cli import main

    code = main(["doctor", config, "--out", out])
    report = json.loads((Path(out) / "report.json").read_text())
    return {"rows": report["dataset"]["samples"], "exit_code": code}


def run_child(which: str, config: Path, cache: Path, work: Path, show: bool) -> dict:
    """One measured process; its figures."""
    stats = work / f"{which}.json"
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", which, str(config), str(work), str(stats)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=None if show else subprocess.PIPE,
        text=True,
    )
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{which} failed ({proc.returncode}):\n{(proc.stderr or '')[-3000:]}")
    return {"seconds": seconds, **json.loads(stats.read_text())}


def remove_packed_rows(cache: Path) -> int:
    """Delete the packed rows a build left in the cache (so that the next start packs)."""
    found = list(cache.rglob("xtuner-rope-packed-*.arrow"))
    for path in found:
        path.unlink()
    return len(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialogues", type=int, default=1_000_000)
    parser.add_argument("--num-proc", type=int, default=1, help="the config's map_num_proc")
    parser.add_argument("--keep", help="work folder to keep (default: a temporary one)")
    parser.add_argument("--progress", action="store_true", help="show the doctor's stderr")
    parser.add_argument(
        "--warm-only", action="store_true", help="write the data and fill the cache, then stop"
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # which config work stats
    args = parser.parse_args()
    if args.child:
        which, config, work, stats = args.child
        figures = child_build(config) if which == "build" else child_doctor(config, work)
        Path(stats).write_text(json.dumps({**figures, **_usage()}))
        return
    work = Path(args.keep or tempfile.mkdtemp(prefix="doctor-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        data, stamp = work / "dialogues.jsonl", work / "dialogues.count"
        if stamp.exists() and stamp.read_text() == str(args.dialogues):  # --keep DIR again
            nbytes = data.stat().st_size
        else:
            nbytes = make_dialogues(args.dialogues, data)
            stamp.write_text(str(args.dialogues))
        config = write_config(work, data, args.num_proc)
        cache = work / "hf_cache"
        start = time.perf_counter()
        run_child("build", config, cache, work, False)  # tokenize once: the warm cache
        warm_up = time.perf_counter() - start
        print(
            f"{args.dialogues} dialogues, {nbytes / 2**20:.0f} MiB of json lines; first build "
            f"(tokenizing, not compared) {warm_up:.0f} s; then each from the warm tokenized "
            f"cache, packed rows removed ({remove_packed_rows(cache)} files)",
            flush=True,
        )
        if args.warm_only:
            return
        results = {}
        for which in ("build", "doctor"):
            remove_packed_rows(cache)
            results[which] = run_child(which, config, cache, work, args.progress)
            print(which, json.dumps({k: round(v, 1) for k, v in results[which].items()}))
        b, d = results["build"], results["doctor"]
        print(
            f"doctor/build: time {d['seconds'] / b['seconds']:.2f}x (CPU time "
            f"{d['cpu_seconds'] / b['cpu_seconds']:.2f}x), peak RSS "
            f"{d['peak_rss_mib'] / b['peak_rss_mib']:.2f}x ({d['peak_rss_mib']:.0f} / "
            f"{b['peak_rss_mib']:.0f} MiB; biggest worker {d['worker_peak_rss_mib']:.0f} / "
            f"{b['worker_peak_rss_mib']:.0f} MiB); rows {d['rows']} / {b['rows']}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
