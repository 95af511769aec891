"""`xtuner train` of a stock config at a real model's size, with and without the one edit.

Issue 48 item 5(c): XTuner's stock ``internlm2_chat_1_8b_full_alpaca_e3`` as ``xtuner copy-cfg``
gives it (packed rows of ``max_length`` tokens, ``pack_to_max_length=True``, AMP), localized as a
user does (a local checkpoint, local alpaca-format data, short chat samples, one packing worker,
no checkpoint saved: the figures are the training's), trained for ``--iters`` iterations twice by
the real ``xtuner train``: once as stock (XTuner's leaky packing: documents attend to each other
without flash-attn) and once with the README's edit (documents isolated). The checkpoint is an
InternLM2 of ``--shapes`` (default InternLM2-1.8B's: 24 layers, hidden 2048, 16/8 heads, vocab
92544) with random weights, initialised on the device and saved with InternLM2's modeling code
and ``auto_map`` as hub checkpoints ship, so the stock run loads it without the plugin; its
tokenizer is the tiny demo one.

From each run's log (``xtuner train`` exits 0 on failure: a run that did not log ``--iters``
iterations with finite losses fails the bench) it prints the mean iteration time after the first
logging window, tokens/s (``batch_size x max_length`` per iteration; with the edit also the real
tokens, from the logged ``real_token_share``) and the peak memory MMEngine logs on CUDA, then the
with/without ratios.

Usage:
    python tools/bench/xtuner_train_gpu.py --device cuda            # on a GPU: about 3 minutes
    python tools/bench/xtuner_train_gpu.py --device cpu --shapes tiny --iters 10 --max-length 256
"""

import argparse
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: tools.zoo
from packing_gpu import SHAPES  # noqa: E402 - tools/bench/packing_gpu.py, this script's sibling

from tools.zoo.classes import stock_texts  # noqa: E402
from tools.zoo.data import write_universal_data  # noqa: E402
from tools.zoo.localize import (  # noqa: E402
    cpu_edits,
    enable_plugin,
    localize_paths,
    one_map_process,
    short_chat_samples,
    sub,
)
from xtuner_rope.demo.resources import tiny_checkpoint  # noqa: E402
from xtuner_rope.demo.runlog import train_losses  # noqa: E402
from xtuner_rope.demo.tiny import TINY_MODEL_KWARGS, add_internlm2_remote_code  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STOCK = "internlm2_chat_1_8b_full_alpaca_e3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LOG_LINE = re.compile(r"Iter\(train\) \[\s*(\d+)/\s*\d+\].*?\btime: ([\d.]+)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="internlm2-1.8b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="AMP dtype on CUDA (the stock config's is float16)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=30, help="training iterations per run")
    parser.add_argument("--interval", type=int, default=5, help="logging window (iterations)")
    parser.add_argument("--max-length", type=int, default=2048, help="packed row length")
    parser.add_argument("--out", default="work_dirs/xtuner_train_bench")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per training run")
    return parser.parse_args(argv)


def build_checkpoint(args, folder: Path) -> Path:
    """An InternLM2 of ``--shapes`` with random weights, its modeling code and ``auto_map``."""
    from xtuner._lite.modelings.internlm2 import InternLM2Config, InternLM2ForCausalLM

    if (folder / "config.json").is_file():
        return folder
    tiny = Path(tiny_checkpoint(str(REPO / "models/tiny-internlm2")))
    config = InternLM2Config(**{**TINY_MODEL_KWARGS, "vocab_size": 1024, **SHAPES[args.shapes]})
    torch.manual_seed(0)
    with torch.device(args.device):  # initialised on the GPU: seconds, not minutes
        model = InternLM2ForCausalLM(config)
    if args.device == "cuda":
        model = model.to(torch.bfloat16)
    model._auto_class = model.config._auto_class = None  # the auto_map is written below
    model.save_pretrained(folder, safe_serialization=True)
    del model
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, folder / name)
    add_internlm2_remote_code(folder)
    return folder


def stock_config(args, model: Path, data: Path) -> str:
    """The stock config as a user localizes it for this run (the edit not made)."""
    text = localize_paths(stock_texts([STOCK])[STOCK], model, data)
    text = short_chat_samples(one_map_process(text))
    if args.device == "cpu":  # fp32 OptimWrapper, no gradient accumulation
        text = cpu_edits(text)
    text, n = sub(text, r"^max_length = .*$", f"max_length = {args.max_length}")
    if n != 1:
        raise SystemExit(f"xtuner_train_gpu: {STOCK} has no 'max_length = ...' line")
    return text


def train(args, config: Path, work_dir: Path, plugin: bool) -> dict:
    """One real ``xtuner train``; its log's figures, or SystemExit naming the log."""
    options = [
        "train_cfg.max_epochs=None",
        f"train_cfg.max_iters={args.iters}",
        f"default_hooks.logger.interval={args.interval}",
        "default_hooks.checkpoint.interval=1000000",
        "default_hooks.checkpoint.save_last=False",
        "randomness.seed=0",
    ]
    if args.device == "cuda":
        options.append(f"optim_wrapper.dtype={args.dtype}")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if args.device == "cpu" and not plugin:
        # XTuner dies on a CPU machine (torch.cpu.is_bf16_supported): the stand-in a GPU has
        # natively. The plugin's compat patches apply; its start-up (the edit) does not run.
        site = work_dir.parent / "site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text("import xtuner_rope\nxtuner_rope.activate()\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    if shutil.which("xtuner", path=env["PATH"]) is None:
        raise SystemExit(
            "xtuner_train_gpu: no `xtuner` command on PATH: install XTuner 0.2.0 (the GPU kit's "
            "run_gpu.sh puts its bin folder first) and run again."
        )
    cmd = ["xtuner", "train", str(config), "--work-dir", str(work_dir), "--cfg-options", *options]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout
    )
    wall = time.perf_counter() - start
    logs = sorted(work_dir.glob("*/*.log"))
    iters, losses = train_losses(work_dir)
    if not logs or not iters or iters[-1] < args.iters or not all(math.isfinite(x) for x in losses):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise SystemExit(
            f"xtuner_train_gpu: the run {'with' if plugin else 'without'} the edit did not "
            f"train {args.iters} iterations with finite losses (logged {iters[-3:]}, losses "
            f"{losses[-3:]}); log: {logs[-1] if logs else 'none'}\n{tail}"
        )
    text = logs[-1].read_text(encoding="utf-8")
    if ("ValidatedRoPEHook:" in text) != plugin:  # the edit ran in one run and only there
        raise SystemExit(
            f"xtuner_train_gpu: the run {'with' if plugin else 'without'} the edit "
            f"{'lacks' if plugin else 'has'} the plugin's hooks; log: {logs[-1]}"
        )
    return read_log(text, wall)


def read_log(text: str, wall: float) -> dict:
    """Iteration times, peak memory (MiB, CUDA only) and real-token shares of a run's log."""
    windows, memory, shares = [], [], []
    for line in text.splitlines():
        match = LOG_LINE.search(line)
        if match is None:
            continue
        windows.append(float(match.group(2)))
        if found := re.search(r"\bmemory: (\d+)", line):
            memory.append(int(found.group(1)))
        if found := re.search(r"\breal_token_share: ([\d.]+)", line):
            shares.append(float(found.group(1)))
    return {
        # the first window holds the warm-up (kernels compiled, allocator growing)
        "iter_time": statistics.mean(windows[1:] or windows),
        "windows": len(windows),
        "memory": max(memory) if memory else None,
        "real_share": statistics.mean(shares) if shares else None,
        "wall": wall,
    }


def report(args, batch_size: int, runs: dict) -> None:
    slots = batch_size * args.max_length
    parts = []
    for name in ("without", "with"):
        r = runs[name]
        line = f"{name} the edit {slots / r['iter_time']:.0f} tokens/s"
        if r["real_share"] is not None:
            line += f" ({slots * r['real_share'] / r['iter_time']:.0f} real)"
        if r["memory"] is not None:
            line += f", peak {r['memory']} MiB"
        parts.append(line + f", {r['iter_time'] * 1e3:.1f} ms/iter, {r['wall']:.0f} s in all")
    ratio = runs["with"]["iter_time"] / runs["without"]["iter_time"]
    memory = ""
    if runs["with"]["memory"] and runs["without"]["memory"]:
        memory = f", peak memory {runs['with']['memory'] / runs['without']['memory']:.3f}x"
    print(
        f"xtuner train {STOCK} ({args.shapes}, {args.device}, "
        f"{args.dtype if args.device == 'cuda' else 'fp32'}, {args.iters} iterations of "
        f"{batch_size} x {args.max_length} tokens): {' | '.join(parts)} -> with / without: "
        f"iteration time {ratio:.3f}x{memory} (mean after the first {args.interval}-iteration "
        "window)"
    )


def main(argv=None):
    """Build, train without and with the edit, print one line; returns both runs' figures."""
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = build_checkpoint(args, out / f"model-{args.shapes}")
    built = time.perf_counter() - start
    # About 60 tokens per alpaca row with the tiny tokenizer: rows for every iteration, and more.
    data = write_universal_data(out / "data", n=max(240, 2 * args.iters * args.max_length // 60))
    text = stock_config(args, model, data)
    batch_size = int(re.search(r"^batch_size = (\d+)", text, re.M).group(1))
    runs = {}
    for name, edited in (("without", text), ("with", enable_plugin(text))):
        config = out / f"{STOCK}_{name}.py"
        config.write_text(edited)
        work_dir = out / f"run-{name}"
        shutil.rmtree(work_dir, ignore_errors=True)
        runs[name] = train(args, config, work_dir, plugin=name == "with")
    print(f"xtuner_train_gpu: checkpoint built in {built:.0f} s")
    report(args, batch_size, runs)
    return runs


if __name__ == "__main__":
    main()
