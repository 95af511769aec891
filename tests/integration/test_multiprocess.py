"""Two CPU processes (DDP, DeepSpeed ZeRO-2 and ZeRO-3 over gloo) train like one, via `xtuner train`.

The runs go through XTuner's real launcher: ``NPROC_PER_NODE=2 xtuner train cfg --launcher
pytorch`` spawns ``torchrun`` exactly as on a GPU node; ``xtuner_rope.compat`` supplies the
CPU-only pieces (gloo instead of NCCL, no ``torch.cuda.set_device``, DDP without
``device_ids``, for DeepSpeed < 0.19 its all-gather outside autograd, and ZeRO-3's coalesced
parameter gather waiting for every all-gather it started).

Why a paired data file: DDP and ZeRO average the per-rank *mean* losses, while one process
takes the mean over all supervised tokens of the global batch. The two agree exactly only
when both ranks hold as many supervised tokens. On the sample data they do not (measured:
1.2e-4 apart at the first iteration, up to 1.3e-2 within ten), so the test writes the
recipe's dialogues in pairs of equal supervised-token count and turns shuffling off: with
``DefaultSampler`` rank r takes items r, r + 2, ..., so every global batch of 16 splits into
two halves of equal token count and the two-process objective *is* the one-process one.
What is left is fp32 summation order (all-reduce, thread count, packed shapes). Every run
trains through the chunked loss (its log says so; under ZeRO-3 the head's partitioned weight is
gathered for the loss as the head's own call); that it equals the full-logits loss on 2
processes under ZeRO-3 is ``tests/integration/test_chunked_loss_zero3.py``.

Opt-in too: issue 57's ZeRO-3 opt-out pair (the ZeRO-3 run against a twin with
``chunked_loss=False``). In CI: the one-process reference and ZeRO-3 (the only 1-vs-2-process check of ZeRO-3's
parameter gather, over 12 iterations). DDP and ZeRO-2 are opt-in (``make test-all``), their
claim proven in CI by the parameters after a step: DDP in
``tests/hooks/test_loss_norm.py::test_one_optimizer_step_whatever_the_grouping``, ZeRO-2 (and
ZeRO-1) in ``tests/integration/test_resume.py::test_two_processes_zero2_step_equals_one_process``.
"""

import os
import re
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from opt_in import again

from xtuner_rope.demo.runlog import check_run

REPO = Path(__file__).resolve().parents[2]
INTERNLM2 = "configs/tiny_internlm2_short_dialogues.py"
QWEN2 = "configs/tiny_qwen2_short_dialogues.py"  # transformers' attention interface path
ZERO2, ZERO3 = "configs/deepspeed/zero2_fp32_cpu.json", "configs/deepspeed/zero3_fp32_cpu.json"
ITERS = 12
GLOBAL_BATCH = 16
NPROC = 2
# fp32 on CPU: summation order differs (gloo all-reduce vs one backward, 1 vs 2 OpenMP threads,
# packed shapes). Measured max |difference| over 12 iterations: 1.2e-6 (DDP and ZeRO-2, also
# with deepspeed 0.17.6 and 0.19.6; ZeRO-3 4.8e-7 with 0.19.6). Unequal halves (the unpaired data) are off by 1e-4 at the
# first iteration and by 1e-2 within ten; a rank skipping the all-reduce, far more.
LOSS_ATOL = 2e-5
ITER_LINE = re.compile(r"Iter\(train\) \[\s*(\d+)/\d+\].*?loss: ([-+0-9.eE]+|nan|inf)")
LOG_EVERY_ITER = (
    "default_hooks.logger.interval=1",
    "log_processor.window_size=1",
    "log_processor.num_digits=8",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    """This venv's bin first on PATH: `xtuner train` spawns `torchrun` by name."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return dict(os.environ, PATH=path, **extra)


def _supervised_counts(config: str) -> list[int]:
    """Supervised (label != -100) tokens of each dialogue, through the recipe's own dataset."""
    from mmengine.config import Config
    from xtuner.registry import BUILDER
    from xtuner.tools.utils import set_model_resource

    cfg = Config.fromfile(str(REPO / config))
    set_model_resource(cfg)  # what `xtuner train` does first (builds the tiny model if missing)
    dataset = BUILDER.build(cfg.train_dataloader.dataset)
    return [sum(label != -100 for label in labels) for labels in dataset["labels"]]


def _write_pairs(config: str, out: Path) -> None:
    """Write the recipe's dialogues as consecutive pairs of equal supervised-token count.

    All pairs are kept (about 2200 of 2400 dialogues), so an epoch stays long enough for the
    recipe's warm-up fraction to cover at least one iteration.
    """
    from mmengine.config import Config

    data_path = REPO / Config.fromfile(str(REPO / config)).data_path
    lines = data_path.read_text(encoding="utf-8").splitlines()
    counts = _supervised_counts(config)
    assert len(counts) == len(lines), "the recipe's dataset dropped dialogues: cannot pair"
    waiting, pairs = {}, []
    for line, count in zip(lines, counts):
        if count in waiting:
            pairs.append((waiting.pop(count), line))
        else:
            waiting[count] = line
    need = ITERS * GLOBAL_BATCH // 2
    assert len(pairs) >= need, f"only {len(pairs)} equal-count pairs, need {need}"
    out.write_text("".join(f"{a}\n{b}\n" for a, b in pairs), encoding="utf-8")


def _cfg_options(data_file: Path, batch_size: int) -> list[str]:
    return [
        "train_cfg.max_epochs=None",
        f"train_cfg.max_iters={ITERS}",
        f"train_dataloader.dataset.dataset.data_files.train={data_file}",
        "train_dataloader.sampler.shuffle=False",
        f"train_dataloader.batch_size={batch_size}",
        "log_level=DEBUG",  # DEBUG makes MMEngine keep one log file per rank
        *LOG_EVERY_ITER,
    ]


def _rank_losses(work_dir: Path) -> dict[int, dict[int, float]]:
    """{rank: {iteration: loss}} from the per-rank logs (or the one log of a single process)."""
    logs = sorted(work_dir.glob("*/*.log"))
    losses = defaultdict(dict)
    for log in logs:
        rank = re.search(r"_rank(\d+)\.log$", log.name)
        for it, loss in ITER_LINE.findall(log.read_text(encoding="utf-8", errors="replace")):
            losses[int(rank.group(1)) if rank else 0][int(it)] = float(loss)
    return dict(losses)


def _global_losses(work_dir: Path, output: str, nproc: int) -> list[float]:
    """Per iteration, the mean over ranks of the logged per-rank loss (the DDP/ZeRO objective);
    every rank's log says the chunked training loss ran."""
    check_run(work_dir, min_iters=ITERS)  # losses logged and a checkpoint saved
    logs = sorted(work_dir.glob("*/*.log"))
    assert len(logs) == nproc and all(
        "xtuner-rope: chunked loss: " in log.read_text(encoding="utf-8") for log in logs
    ), output
    by_rank = _rank_losses(work_dir)
    assert sorted(by_rank) == list(range(nproc)), f"ranks logged: {sorted(by_rank)}\n{output}"
    for rank, losses in by_rank.items():
        assert sorted(losses) == list(range(1, ITERS + 1)), f"rank {rank}: {sorted(losses)}"
    return [sum(by_rank[r][i] for r in range(nproc)) / nproc for i in range(1, ITERS + 1)]


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


_REFERENCES: dict[str, tuple] = {}  # recipe -> the fixture's value, one run per module


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """The paired data file and the one-process losses (global batch 16) for one recipe (pytest
    sets the fixture up again for each test function that parametrizes it: made once here)."""
    if request.param in _REFERENCES:
        return _REFERENCES[request.param]
    tmp = tmp_path_factory.mktemp("multiprocess")
    data_file = tmp / "paired_dialogues.jsonl"
    _write_pairs(request.param, data_file)
    work_dir = tmp / "one_process"
    cmd = [
        sys.executable,
        "-m",
        "xtuner.tools.train",
        request.param,
        "--work-dir",
        str(work_dir),
        "--cfg-options",
        *_cfg_options(data_file, GLOBAL_BATCH),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _tail(proc)
    losses = _global_losses(work_dir, _tail(proc), 1)
    _REFERENCES[request.param] = request.param, data_file, losses
    return _REFERENCES[request.param]


# How often the opt-in repeated check runs the 2-process ZeRO-3 case (0: not at all, as in CI).
# ZeRO-3 on CPU was wrong in about 1 run in 3 before `deepspeed_cpu.patch_deepspeed_zero3_cpu_gather`.
REPEAT_ZERO3 = int(os.environ.get("XTUNER_ROPE_REPEAT_ZERO3", "0"))


def _two_process_run(
    config: str, data_file: Path, deepspeed, work_dir: Path, *extra: str
) -> tuple[Path, str]:
    """`xtuner-rope train` (XTuner's torchrun launch, with its status) on 2 CPU processes; the
    work dir and the output's tail."""
    cmd = ["xtuner-rope", "train", config, "--work-dir", str(work_dir), "--launcher", "pytorch"]
    if deepspeed:
        cmd += ["--deepspeed", deepspeed]
    cmd += ["--cfg-options", *_cfg_options(data_file, GLOBAL_BATCH // NPROC), *extra]
    env = _env(NPROC_PER_NODE=str(NPROC), NNODES="1", PORT=str(_free_port()))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    # `xtuner train` would exit 0 even when its torchrun failed; `xtuner-rope train` does not.
    assert proc.returncode == 0, _tail(proc)
    return work_dir, _tail(proc)


_SHARED: dict[tuple, tuple[Path, str]] = {}  # (config, deepspeed, *extra) -> one run, shared


def _shared_run(reference, deepspeed, tmp_path_factory, *extra: str) -> tuple[Path, str]:
    """The 2-process run of ``reference``'s recipe, made once per module (the ZeRO-3 run is the
    1-vs-2-process check's and the chunked partner of its ``chunked_loss=False`` twin)."""
    config, data_file, _ = reference
    key = (config, deepspeed, *extra)
    if key not in _SHARED:
        work_dir = tmp_path_factory.mktemp("two_processes")
        _SHARED[key] = _two_process_run(config, data_file, deepspeed, work_dir, *extra)
    return _SHARED[key]


@pytest.mark.slow
@pytest.mark.parametrize(
    "reference,deepspeed",
    [
        # DDP on 2 processes equal to one: proven in CI by test_loss_norm's one-step run
        # (packed 4x2 on 2 processes under DDP against padded 16x1 on one, the parameters).
        pytest.param(
            INTERNLM2,
            None,
            marks=again(
                "tests/hooks/test_loss_norm.py::test_one_optimizer_step_whatever_the_grouping"
            ),
        ),
        # ZeRO-2 on 2 processes equal to one: proven in CI by test_resume's 1-vs-2-process
        # step (its sft-zero2 run, parameters after 8 iterations, also read by 3 other tests).
        pytest.param(
            INTERNLM2,
            ZERO2,
            marks=again("test_resume.py::test_two_processes_zero2_step_equals_one_process[sft]"),
        ),
        (INTERNLM2, ZERO3),
        # Two processes over the same DDP path as internlm2-ddp (in CI: test_loss_norm's DDP
        # step); Qwen2's attention path is trained isolated in CI by test_e2e's Qwen2 recipe.
        pytest.param(
            QWEN2,
            None,
            marks=again("test_loss_norm's DDP step and test_e2e::test_tiny_qwen2_recipe_*"),
        ),
    ],
    ids=["internlm2-ddp", "internlm2-zero2", "internlm2-zero3", "qwen2-ddp"],
    indirect=["reference"],
)
def test_two_processes_match_one(reference, deepspeed, tmp_path_factory):
    one = reference[2]
    two = _global_losses(*_shared_run(reference, deepspeed, tmp_path_factory), NPROC)
    worst = max(abs(a - b) for a, b in zip(one, two))
    print(f"{deepspeed or 'ddp'}: max |1 - 2 processes| loss over {ITERS} iters: {worst:.2e}")
    assert worst <= LOSS_ATOL, f"1 process: {one}\n2 processes: {two}"
    assert one[-1] < one[0] - 0.2, f"the loss did not fall: {one}"  # it really trained


# The weights of the ZeRO-3 opt-out pair: 1e-5, not the 1e-6. The recipe's AdamW makes a
# step of the learning rate's size (3e-3) from any gradient, also one of rounding size: an element
# whose gradient is near 0 moves by the sign of the summation order's noise. Measured 3.7e-6
# (2026-11-29), most of it one element of the input embedding (row 16: moved 1.25e-3 chunked,
# 1.33e-3 with the model's own loss, 7.8e-5 apart); the other tensors are within 3e-7 relative
# but the attention's biases (8.9e-6 and 3.7e-6 of their small norms: their gradient is mostly
# noise). The losses, which the weights feed at every iteration, stay within 2.1e-7.
ZERO3_WEIGHTS_RTOL = 1e-5


@pytest.mark.slow
@again("tests/integration/test_chunked_loss_zero3.py (2 processes, the head partitioned)")
@pytest.mark.parametrize("reference", [INTERNLM2], indirect=True)
def test_zero3_chunked_loss_equals_the_models_own(reference, tmp_path_factory):
    """Issue 57's opt-out pair under ZeRO-3 on 2 processes: the internlm2-zero3 run above
    (chunked, logged on each rank) and the same run with ``chunked_loss=False`` give each rank's
    loss at each of the 12 iterations within 1e-6 relative (read from the per-rank logs, 8
    decimals; measured 2.1e-7) and the final weights (DeepSpeed's fp32 partitions, gathered)
    within ``ZERO3_WEIGHTS_RTOL`` relative norm. The json's default
    ``stage3_param_persistence_threshold`` (1e5 elements) keeps the tiny model's parameters (the
    head: 65,536) whole on every rank, each still a ZeRO-3 parameter; the chunked loss on a
    partitioned head (threshold 0) is ``test_chunked_loss_zero3.py``'s."""
    from opt_out import OPT_OUT, OWN_LINE, RTOL, relative_norm, weights, worst_relative

    (chunked, _), (own, out) = (
        _shared_run(reference, ZERO3, tmp_path_factory, *extra) for extra in ((), (OPT_OUT,))
    )
    logs = sorted(own.glob("*/*.log"))
    assert len(logs) == NPROC and all(OWN_LINE in log.read_text() for log in logs), out
    _global_losses(chunked, "", NPROC)  # each rank logged the chunked loss, every iteration
    got, want = _rank_losses(chunked), _rank_losses(own)
    assert sorted(got) == sorted(want) == list(range(NPROC)), (got, want)
    steps = list(range(1, ITERS + 1))
    loss = max(worst_relative([got[r][i] for i in steps], [want[r][i] for i in steps]) for r in got)
    final = f"iter_{ITERS}.pth"
    weight = relative_norm(weights(chunked / final), weights(own / final))
    print(
        f"zero3 chunked vs chunked_loss=False, worst relative: loss {loss:.2g}, weights {weight:.2g}"
    )
    assert loss <= RTOL and weight <= ZERO3_WEIGHTS_RTOL, (loss, weight)


@pytest.mark.slow
@pytest.mark.skipif(REPEAT_ZERO3 <= 0, reason="opt-in: XTUNER_ROPE_REPEAT_ZERO3=<runs>")
@pytest.mark.parametrize("reference", [INTERNLM2], indirect=True)
def test_zero3_repeated_runs_are_all_right(reference, tmp_path):
    """The 2-process ZeRO-3 case XTUNER_ROPE_REPEAT_ZERO3 times: no run may be wrong.

    ``XTUNER_ROPE_REPEAT_ZERO3=10 pytest -s tests/test_multiprocess.py -k repeated`` (about
    1-2 minutes a run); a wrong run failed about 1 time in 3 before the compat patch.
    """
    config, data_file, one = reference
    worst = []
    for run in range(REPEAT_ZERO3):
        work_dir, out = _two_process_run(config, data_file, ZERO3, tmp_path / f"run{run}")
        two = _global_losses(work_dir, out, NPROC)
        worst.append(max(abs(a - b) for a, b in zip(one, two)))
        print(
            f"zero3 run {run + 1}/{REPEAT_ZERO3}: max |1 - 2 processes| loss {worst[-1]:.2e}",
            flush=True,
        )
    wrong = [f"run {i + 1}: {w:.2e}" for i, w in enumerate(worst) if w > LOSS_ATOL]
    print(f"zero3: {len(wrong)} wrong runs of {REPEAT_ZERO3}")
    assert not wrong, f"{len(wrong)} of {REPEAT_ZERO3} ZeRO-3 runs off by more than {LOSS_ATOL}"


def test_log_parser_reads_per_rank_files(tmp_path):
    """The per-rank log names MMEngine 0.10.6 writes at DEBUG level, and a plain log."""
    run = tmp_path / "20260101_000000"
    run.mkdir()
    line = (
        "2026/01/01 00:00:01 - mmengine - INFO - Iter(train) [ {i}/12]  lr: 3.0e-05  "
        "grad_norm: 1.85  loss: {loss}\n"
    )
    (run / "20260101_000000_host_device0_rank0.log").write_text(line.format(i=1, loss="6.5"))
    (run / "20260101_000000_host_device1_rank1.log").write_text(line.format(i=1, loss="6.25"))
    assert _rank_losses(tmp_path) == {0: {1: 6.5}, 1: {1: 6.25}}
    (tmp_path / "solo" / "20260101_000000").mkdir(parents=True)
    (tmp_path / "solo" / "20260101_000000" / "20260101_000000.log").write_text(
        line.format(i=12, loss="nan")
    )
    losses = _rank_losses(tmp_path / "solo")
    assert list(losses) == [0] and losses[0][12] != losses[0][12]  # nan is read, then rejected
