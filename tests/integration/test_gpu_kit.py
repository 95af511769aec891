"""The GPU kit and the GPU benches, on CPU: parts split and reassembled, pins, bench runs.

The full offline rehearsal (build a kit for .venv's Python, install it with no index into a
fresh folder over an emulated GPU image, run the suite's GPU files there) downloads about
25 MB: opt-in with XTUNER_ROPE_KIT_TEST=1.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from varlen_reference import varlen_attn_2_12

from xtuner_rope.ops import attention
from xtuner_rope.ops.attention import VarlenKernel
from xtuner_rope.ops.rope_triton import INTERPRET_ENV, interpreter_fault

REPO = Path(__file__).resolve().parents[2]


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = _load("tools/gpu/kit.py", "gpu_kit_tool")


def _wheels(folder, sizes):
    folder.mkdir()
    for i, size in enumerate(sizes):
        (folder / f"pkg{i}-1.0-py3-none-any.whl").write_bytes(os.urandom(size))


def test_split_keeps_parts_under_the_cap_and_assembles_byte_identical(tmp_path):
    sizes = [900_000, 300_000, 250_000, 40_000, 10]  # the first is larger than a part
    _wheels(tmp_path / "wheels", sizes)
    parts = kit.split(tmp_path / "wheels", tmp_path / "kit", part_mib=0.5)
    assert len(parts) >= 3
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= 0.5 * kit.MIB
    out = kit.assemble(tmp_path / "kit", tmp_path / "out")
    assert len(out) == len(sizes)
    for wheel in (tmp_path / "wheels").iterdir():
        assert (tmp_path / "out" / wheel.name).read_bytes() == wheel.read_bytes()


def test_assemble_names_the_missing_part_and_refuses_corrupt_wheels(tmp_path):
    _wheels(tmp_path / "wheels", [900_000, 300_000])
    kit.split(tmp_path / "wheels", tmp_path / "kit", part_mib=0.5)
    piece = next((tmp_path / "kit" / "part2").iterdir())
    data = piece.read_bytes()
    piece.unlink()
    with pytest.raises(SystemExit, match=r"part2 of .*kit not here: carry them"):
        kit.assemble(tmp_path / "kit", tmp_path / "out")
    piece.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(SystemExit, match=r"does not match its sha256: rebuild the kit"):
        kit.assemble(tmp_path / "kit", tmp_path / "out")
    with pytest.raises(SystemExit, match=r"part1/MANIFEST.json is missing: carry"):
        kit.assemble(tmp_path / "nothing", tmp_path / "out")


def _pins(path):
    lines = (line.strip() for line in (REPO / path).read_text().splitlines())
    pairs = (line.split("==") for line in lines if line and not line.startswith("#"))
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pairs}


def test_kit_pins_are_the_tested_versions():
    constraints, kit_pins = _pins("constraints.txt"), _pins("tools/gpu/kit_requirements.txt")
    assert {"xtuner", "mmengine", "transformers", "datasets"} <= set(kit_pins)
    assert "bitsandbytes" not in kit_pins  # 66 MiB of CUDA 11-12 binaries; the check runs no QLoRA
    assert {name: v for name, v in kit_pins.items() if constraints.get(name) != v} == {}


def test_split_refuses_a_kit_of_more_than_one_part(tmp_path):
    """`make gpu-kit` builds one part (one call carries it); more is refused, naming the wheels."""
    _wheels(tmp_path / "wheels", [400_000, 300_000])
    with pytest.raises(SystemExit, match=r"more than 1 part\(s\) of 0.5 MiB; the largest: pkg0"):
        kit.split(tmp_path / "wheels", tmp_path / "kit", part_mib=0.5, max_parts=1)
    assert not (tmp_path / "kit").exists()
    _wheels(tmp_path / "small", [200_000, 100_000])
    assert len(kit.split(tmp_path / "small", tmp_path / "kit", part_mib=0.5, max_parts=1)) == 1


def _run_gpu_plan():
    """run_gpu.sh's step budgets, its step order, quick steps and totals, as the script has them."""
    text = (REPO / "tools/gpu/run_gpu.sh").read_text()
    block = re.search(r"declare -A BUDGET=\((.*?)\n\)", text, re.S).group(1)
    budgets = {name: int(sec) for name, sec in re.findall(r"\[(\w+)\]=(\d+)", block)}
    order = re.search(r'^ORDER="([^"]+)"', text, re.M).group(1).split()
    quick = re.search(r'^QUICK_STEPS="([^"]+)"', text, re.M).group(1).split()
    train = re.search(r'^TRAIN_STEPS="([^"]+)"', text, re.M).group(1).split()
    total = int(re.search(r"^TOTAL=(\d+)", text, re.M).group(1))
    quick_total = int(re.search(r"^QUICK_TOTAL=(\d+)", text, re.M).group(1))
    train_total = int(re.search(r"^TRAIN_TOTAL=(\d+)", text, re.M).group(1))
    recipes = re.search(r"^for recipe in ([\w ]+); do", text, re.M).group(1).split()
    called = []  # the steps in the order the script calls them
    for name in re.findall(r'^\s*(?:step|bench) "?([\w$]+)', text, re.M):
        if name != "$":  # `step "$@"` inside bench()
            called += [f"check_{r}" for r in recipes] if name == "check_$recipe" else [name]
    return budgets, order, quick, total, quick_total, called, train, train_total


def _documented_timeouts():
    """The `timeout_s` docs/gpu.md gives the full check's `run` call, the --quick and --train
    ones."""
    text = (REPO / "docs/gpu.md").read_text()
    full = re.search(r'"command": "bash tools/gpu/run_gpu.sh", .*"timeout_s": (\d+)\}', text)
    quick = re.search(r'--quick`\s+with `"timeout_s": (\d+)`', text)
    train = re.search(
        r'"command": "bash tools/gpu/run_gpu.sh --train", .*"timeout_s": (\d+)\}', text
    )
    return int(full.group(1)), int(quick.group(1)), int(train.group(1))


def test_run_gpu_step_budgets_fit_one_short_loan():
    """Every step has a budget; they add up to the deadline, which, with the last step's
    kill-after and 15 s to spare, fits the `timeout_s` the docs give the call (also for --quick,
    correctness first); every budgeted step is run, in the order of the budgets."""
    budgets, order, quick, total, quick_total, called, train, train_total = _run_gpu_plan()
    full_timeout, quick_timeout, train_timeout = _documented_timeouts()
    script = (REPO / "tools/gpu/run_gpu.sh").read_text()
    kill_after = int(re.search(r"timeout --kill-after=(\d+)", script).group(1))
    assert total + kill_after + 15 <= full_timeout, (total, full_timeout)
    assert quick_total + kill_after + 15 <= quick_timeout, (quick_total, quick_timeout)
    assert train_total + kill_after + 15 <= train_timeout, (train_total, train_timeout)
    assert sum(budgets[s] for s in order) <= total, budgets
    assert sum(budgets[s] for s in quick) <= quick_total
    assert sum(budgets[s] for s in train) <= train_total
    assert sorted(set(order) | set(train)) == sorted(budgets) and order[: len(quick)] == quick
    assert quick[-1] == "correctness" and train == [*order[:2], "train"]
    assert called == [*order[:2], "train", *order[2:]]  # --train ends after its step
    # a loan (900 s of device time, ~50 s to start a machine) holds both calls and a --quick
    assert 50 + full_timeout + train_timeout + quick_timeout <= 900


def test_rope_bench_checks_then_times_both_triton_kernels_interpreted(monkeypatch, capsys):
    """The kit's rope step on CPU under Triton's interpreter: the package's kernel and Liger's
    checked against HF's fp32 apply (fp16, InternLM2's transposed q/k views, forward and
    backward), then timed beside HF's apply; a kernel that rotates wrongly fails the check."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    if interpreter_fault():
        pytest.skip(interpreter_fault())
    bench = _load("tools/bench/rope.py", "rope_bench")
    shape = "--seq 24 --heads 4 --kv-heads 2 --head-dim 32 --repeats 1 --warmup 0".split()
    results = bench.main([*shape, "--dtype", "fp16", "--transposed", "--no-fused", "--both"])
    out = capsys.readouterr().out
    assert re.search(r"^triton kernel vs HF's fp32 apply, torch.float16 .*: PASS", out, re.M)
    assert re.search(r"^liger vs HF's fp32 apply, torch.float16 .*: PASS", out, re.M)
    for backward in (False, True):
        assert {"clone", "hf-eager", "xtuner_rope-triton", "liger"} <= set(results[backward])
    assert re.search(r"rope apply fwd\+bwd fp16 .*\| liger [\d.]+x", out)
    q, k, cos, sin, grads = bench.make_inputs(bench.parse_args(shape))

    def swapped(q, k, cos, sin):  # sin for cos: a wrong rotation
        return bench.hf_apply_rotary_pos_emb(q, k, sin, cos)

    assert not bench.checked("swapped", swapped, q, k, cos, sin, grads)
    assert not bench.checked("swapped", swapped, q, k, cos, sin, grads, peer=True)
    # --sweep (the kit's): every shape checked and timed, batch rows sharing --seq tokens
    monkeypatch.setattr(bench, "SWEEP", {"gqa": (1, 4, 2, 32, False), "rows": (2, 4, 4, 16, True)})
    swept = bench.main([*shape, "--no-fused", "--sweep", "--tiles", "256"])
    assert list(swept) == ["gqa", "rows"] and "liger" in swept["rows"][False]
    assert "xtuner_rope-triton-tile256" in swept["gqa"][False]  # a tile to choose on a GPU
    out = capsys.readouterr().out
    assert "== rows" in out and "triton kernel (tile 256) vs HF's fp32 apply" in out


def test_rope_bench_marks_a_kernel_that_fell_back_failed_and_does_not_time_it(monkeypatch, capsys):
    """Triton's launcher failing (as a compile failure would): the package's apply falls back
    to the eager kernel, which is right, so only the launch count tells; the bench prints the
    kernel's rows FAILED, times the others, and exits 1."""
    from xtuner_rope.ops import rope_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    monkeypatch.delenv(rope_triton.STRICT_ENV, raising=False)
    if interpreter_fault():
        pytest.skip(interpreter_fault())
    monkeypatch.setitem(rope_triton._state, "compiled", set())

    def run(*args, **kwargs):
        raise RuntimeError("injected: the kernel does not compile")

    monkeypatch.setattr(rope_triton._kernel(), "run", run)
    bench = _load("tools/bench/rope.py", "rope_bench_failed")
    shape = "--seq 24 --heads 4 --kv-heads 2 --head-dim 32 --repeats 1 --warmup 0"
    with pytest.warns(RuntimeWarning, match="injected"):
        results = bench.main([*shape.split(), "--dtype", "fp32", "--no-fused", "--both"])
    out = capsys.readouterr().out
    assert "triton kernel: FAILED, it fell back to the eager kernel (0 of 2 launches)" in out
    for backward in (False, True):
        row = results[backward]
        assert row["xtuner_rope-triton"] is None and row["xtuner_rope"] is None
        assert row["hf-eager"] > 0 and row["xtuner_rope-eager"] > 0
    assert re.search(r"xtuner_rope-triton FAILED \(fell back to the eager kernel", out)
    assert set(bench.FAILURES) == {"xtuner_rope", "xtuner_rope-triton"}
    failed = {}  # a kernel that falls back while timed (after its check passed) fails too
    bench.counted(lambda: None, 2, "xtuner_rope-triton", failed)()
    assert failed == {"xtuner_rope-triton": "fell back to the eager kernel (0 of 2 launches)"}
    rope_triton.use_triton_apply(None)


def test_packing_bench_times_isolated_leaky_and_padded_steps_per_capacity(capsys):
    """The kit's training-step bench at tiny shapes on the CPU: the three variants at two row
    capacities, each batch about one row of dialogues; memory is not measured on the CPU."""
    bench = _load("tools/bench/packing_gpu.py", "packing_gpu_bench")
    argv = "--device cpu --shapes tiny --dtype fp32 --max-length 256 512 --train-batches 1"
    results = bench.main([*argv.split(), "--repeats", "1", "--warmup", "0"])
    assert [m["max_length"] for m in results] == [256, 512]
    for m in results:
        assert set(m["seconds"]) == {"isolated", "leaky", "padded"}
        assert m["rows"] == 1 and m["slots"]["packed"] <= m["max_length"] <= 2 * m["real"]
        assert m["peak"] == {"isolated": None, "leaky": None, "padded": None}
    out = capsys.readouterr().out
    assert re.search(r"isolated / leaky [\d.]+x \(goal <= 1.02x\).* -> [\d.]+x padded", out)
    assert "peak memory: not measured on the CPU" in out


def test_packing_bench_leaky_variant_leaks_across_documents():
    """The bench's ``leaky`` model is the unpatched one on the packed rows: on a row of 2+
    documents its logits equal the isolated model's on the first document and differ after it
    (that isolated equals each document alone is proven in the packing tests)."""
    import torch

    bench = _load("tools/bench/packing_gpu.py", "packing_gpu_bench")
    args = bench.parse_args("--device cpu --shapes tiny --dtype fp32 --max-length 512".split())
    args.max_length = 512
    items, vocab_size = bench.cpu_bench.load_items(args)
    base = bench.build_model(args, vocab_size)
    isolated = bench.copy.deepcopy(base)
    bench.patch_model(isolated)
    dialogues = items[: bench.batch_size_for(items, 512)]
    data = dict(bench.cpu_bench.packed(dialogues, args)["data"])
    starts = (data["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) >= 2 and starts[0] == 0, starts  # 2+ documents in the first row
    # the bench's own isolated variant: its hook and runner, as the timed steps use them
    variant = bench.DeviceVariant(
        "isolated", isolated, [], bench.PackedBatchCheckHook(), device="cpu"
    )
    batch = {"data": data, "data_samples": None}
    variant.hook.before_train_iter(variant.runner, 0, data_batch=batch)  # publishes boundaries
    with torch.no_grad():
        isolated_logits = isolated(**data).logits[0]
        variant.hook.after_train_iter(variant.runner, 0, data_batch=batch)
        for key in ("cumulative_len", "max_seqlen", "num_unsupervised"):
            data.pop(key, None)
        leaky_logits = base(**data).logits[0]
    first = slice(0, starts[1])
    assert torch.allclose(isolated_logits[first], leaky_logits[first], atol=1e-5)
    assert not torch.allclose(isolated_logits[starts[1] :], leaky_logits[starts[1] :], atol=1e-3)


# Lines of the bench's real tiny runs on the CPU (the edit's metrics in the first); the
# ``memory`` field is the one MMEngine's LogProcessor adds on CUDA ("memory: {MB}").
TRAIN_LOG = """\
2026/11/28 22:51:31 - mmengine - INFO - Iter(train) [ 5/10]  lr: 3.0000e-03  eta: 0:00:00  \
time: 0.0601  data_time: 0.0024  memory: 20100  docs_per_row: 4.2000  real_token_share: 0.9000  \
longest_doc: 96.0000  grad_norm: 2.1919  loss: 6.8723
2026/11/28 22:51:31 - mmengine - INFO - Iter(train) [10/10]  lr: 2.9913e-03  eta: 0:00:00  \
time: 0.0202  data_time: 0.0023  memory: 20480  docs_per_row: 4.4000  real_token_share: 1.0000  \
longest_doc: 115.0000  grad_norm: 1.7848  loss: 6.7194
2026/11/28 22:51:13 - mmengine - INFO - Iter(train) [ 5/10]  lr: 3.0000e-03  eta: 0:00:00  \
time: 0.0227  data_time: 0.0013  grad_norm: 2.3278  loss: 6.9061
"""


def test_train_bench_reads_iteration_time_memory_and_real_share_from_the_log():
    bench = _load("tools/bench/xtuner_train_gpu.py", "xtuner_train_bench")
    edited, stock = TRAIN_LOG.splitlines()[:2], TRAIN_LOG.splitlines()[2:]
    figures = bench.read_log("\n".join(edited), wall=18.0)
    assert figures["iter_time"] == 0.0202  # the first window (warm-up) left out
    assert (figures["memory"], figures["real_share"], figures["windows"]) == (20480, 0.95, 2)
    figures = bench.read_log("\n".join(stock), wall=21.0)
    assert figures["iter_time"] == 0.0227 and figures["memory"] is None  # one window: kept
    assert figures["real_share"] is None


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("XTUNER_ROPE_TRAIN_BENCH_BY_HAND"),
    reason="two real `xtuner train` runs (~1 min): set XTUNER_ROPE_TRAIN_BENCH_BY_HAND=1",
)
def test_train_bench_trains_the_stock_config_with_and_without_the_edit(tmp_path, capsys):
    """The kit's `xtuner train` step at tiny shapes on the CPU: both runs train, the edit's run
    has the plugin's hooks and the stock one has none (the bench checks both logs)."""
    bench = _load("tools/bench/xtuner_train_gpu.py", "xtuner_train_bench")
    argv = f"--device cpu --shapes tiny --iters 10 --max-length 256 --out {tmp_path}"
    runs = bench.main(argv.split())
    assert runs["with"]["real_share"] is not None and runs["without"]["real_share"] is None
    assert "-> with / without: iteration time" in capsys.readouterr().out


def test_attention_bench_runs_every_candidate_on_cpu(monkeypatch, capsys):
    """With the reference kernel installed for CPU, the varlen candidates run too."""
    monkeypatch.setattr(attention, "VARLEN_KERNEL", VarlenKernel(varlen_attn_2_12, ("cpu",)))
    bench = _load("tools/bench/attention.py", "attention_bench")
    results = bench.main(
        [
            "--tokens",
            "64",
            "96",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--max-doc",
            "20",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-flex",
        ]
    )
    assert set(results[96]) == {"varlen_attn", "ours-varlen", "ours-buckets", "dense-mask"}
    out = capsys.readouterr().out
    assert "t=96" in out and "varlen_attn 1.00x" in out and "flex skipped" in out
    assert re.search(
        r"plan per forward t=96 .* host boundaries [\d.]+ ms \| from position ids", out
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("XTUNER_ROPE_KIT_TEST"),
    reason="downloads ~25 MB: set XTUNER_ROPE_KIT_TEST=1",
)
def test_kit_installs_offline_and_the_suite_skips_its_gpu_tests(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {
        **os.environ,
        "PYVER": version,
        "KIT": str(tmp_path / "kit"),
        "PY": sys.executable,
        "WORK": str(tmp_path / "work"),
    }
    subprocess.run(["bash", "tools/gpu/build_kit.sh"], cwd=REPO, env=env, check=True)
    done = subprocess.run(
        ["bash", "tools/gpu/rehearse_cpu.sh", str(tmp_path / "kit")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    parts = sorted(p.name for p in (tmp_path / "kit").iterdir())
    size = sum(f.stat().st_size for f in (tmp_path / "kit" / "part1").iterdir())
    assert parts == ["part1"] and size <= 58 * kit.MIB, (parts, size)
    summary = (tmp_path / "work" / "out" / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout[-3000:]
    assert re.search(r"^correctness rc=0 \d+s of \d+s", summary, re.M), summary


def test_loss_bench_runs_each_variant_in_its_own_process_at_a_tiny_shape(capsys):
    """tools/bench/loss.py --quick on the CPU: the full-logits and the chunked loss, and DPO's
    log-probs through both, each in a fresh process, the same losses, their peaks and ratios
    printed; Liger skipped (CUDA only); ``--frozen-head`` freezes the head's weight."""
    bench = _load("tools/bench/loss.py", "loss_bench")
    row = bench.main(["--quick"])[(256, 1000)]
    assert row["liger"] == {"skipped": bench.liger_skip("cpu")}
    for ours, base in (("chunked", "full"), ("chunked-logprobs", "full-logprobs")):
        for variant in (ours, base):
            assert row[variant]["seconds"] > 0 and row[variant]["peak"] >= 0
        assert abs(row[ours]["loss"] - row[base]["loss"]) <= 1e-5 * row[base]["loss"]
    out = capsys.readouterr().out
    assert re.search(r"chunked / full: memory [\d.]+x \(goal <= 0.15x\), time [\d.]+x", out)
    assert re.search(r"chunked-logprobs / full-logprobs: memory [\d.]+x", out)
    assert re.search(r"fp32 gradient alone: .* chunked beyond it: -?[\d,]+ MiB = -?[\d.]+x", out)
    args = ["--quick", "--frozen-head", "--variant", "chunked-logprobs"]
    frozen = bench.run_variant(bench.parse_args(args))  # in this process: no import to wait for
    assert (frozen["trained"], row["chunked-logprobs"]["trained"]) == (False, True)
    assert frozen["loss"] == row["chunked-logprobs"]["loss"]
    lora = [  # a frozen head with a rank-4 LoRA (peft's module), both losses on it
        bench.run_variant(bench.parse_args(["--quick", "--lora-head", "4", "--variant", v]))
        for v in ("full", "chunked")
    ]
    assert lora[0]["lora"] == lora[1]["lora"] == 4 * (64 + 1000), lora
    assert abs(lora[0]["loss"] - lora[1]["loss"]) <= 1e-5 * lora[0]["loss"], lora
    assert lora[0]["loss"] != row["full"]["loss"]  # the adapters count
    # a variant that cannot fit is skipped, not run into the OOM killer
    assert bench.estimated_need("full", 8192, 151936, 2048, 4) > 16 * 2**30
