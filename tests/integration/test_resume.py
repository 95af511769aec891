"""A run SIGKILLed inside an accumulation window and resumed ends where the uninterrupted run ends.

Each scenario trains a recipe three times through the real ``xtuner train``: uninterrupted; again
with a hook that sends its own process a real ``SIGKILL`` after a mid-window iteration; and
``--resume`` from the newest checkpoint the killed run wrote. ``save_steps`` is deliberately not a
multiple of ``accumulative_counts``: the start-up raises the checkpoint interval to the next
multiple (logged), so the killed run's newest checkpoint sits at a window boundary and the resumed
run's final weights equal the uninterrupted run's (fp32, CPU, same seed: measured 0.0; asserted
<= 1e-6 relative). Before the start-up fix, a checkpoint inside the window lost its gradients
(9.4e-3 on the tiny recipe, 3.3e-4 on the DPO pairs).

Scenarios: the tiny recipe (SFT) and the DPO pairs recipe, each with the plain ``OptimWrapper``
on one process and DeepSpeed ZeRO-2 on two (SFT's kill and resume, and DPO's on one process,
by hand: ``XTUNER_ROPE_RESUME_BY_HAND=1``; CI kills the same recipes elsewhere), and a stock config
(``xtuner copy-cfg``); the same pairs as XTuner's ORPO and the reward-model recipe under ZeRO-2
on two (opt-in: ``XTUNER_ROPE_RESUME_BY_HAND=1``, measured 0.0 each). The tiny
recipe with a LoRA adapter (dropout 0.1), on one process and under ZeRO-2 and ZeRO-3 (DDP and
ZeRO-1 opt-in: ``XTUNER_ROPE_RESUME_BY_HAND=1``), needs each process's random state restored
too (``RandomStateHook``; without it 1.4e-1 and 1.8e-1; in CI the ZeRO-2 and ZeRO-3 rows
resume from the uninterrupted run's ``iter_4.pth/``, the checkpoint the killed run resumes from,
and are killed by hand: ``RESUMED_FROM_STRAIGHT``); the same holds
for issue 40's LLaVA LoRA finetune (opt-in: ``XTUNER_ROPE_LLAVA_RESUME=1``, minutes). SGD with
momentum (state to resume), constant LR, no clipping. The one-process and two-process runs see the
same micro-batches per optimizer step, so their uninterrupted runs must also agree with each other
(the token/pair-weighted step under ZeRO-2, and ZeRO-1 for SFT: one more run).

Opt-in too (``XTUNER_ROPE_RESUME_BY_HAND=1``): the stock config at sequence parallel 2 (ZeRO-2)
killed and resumed, and rank 1 SIGKILLed inside DeepSpeed's write of a ZeRO-2 checkpoint folder
(refused on ``--resume``, skipped with a warning by ``resume = True``).

Another number of processes: a plain checkpoint of 2 processes resumes on 1, and the documents
trained twice are counted against the log's account; a ZeRO checkpoint of 2 processes is refused
on 1 before anything is built (the sft-zero2 scenario's uninterrupted checkpoint, shared).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import stock_configs as sc
import torch

from xtuner_rope.checkpoints.complete import judge_checkpoint
from xtuner_rope.demo.runlog import check_run, train_losses

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
ZERO2 = "configs/deepspeed/zero2_fp32_cpu.json"
ZERO3 = "configs/deepspeed/zero3_fp32_cpu.json"
RESUME_RTOL = 1e-6  # the bound; measured 0.0
STRATEGY_RTOL = 1e-5  # 1 vs 2 processes: fp32 summation order (packing, all-reduce)
KILL_HOOK = "from sigkill_hook import SigkillAtIterationHook, SigkillDuringCheckpointWriteHook\n"
SGD_STEP = """
optim_wrapper = dict(
    type=OptimWrapper,
    optimizer=dict(type=SGD, lr={lr}, momentum=0.9, weight_decay=0.0),
    clip_grad=dict(max_norm=1e9),  # never clips (DeepSpeed would default to 1.0)
    accumulative_counts=accumulative_counts,
)
param_scheduler = []  # constant LR
custom_hooks.append(dict(type=SigkillAtIterationHook))
custom_hooks.append(dict(type=SigkillDuringCheckpointWriteHook))
"""


def _edit(text: str, edits: list[tuple[str, str]]) -> str:
    for pattern, new in edits:
        text = sc.sub_once(text, pattern, new)
    return text


def _recipe(tmp: Path, name: str, text: str, *, counts: int, save_steps: int, lr: float) -> Path:
    """A config with accumulation ``counts``, ``save_steps``, SGD and the kill hook."""
    text = _edit(
        text,
        [
            (r"^accumulative_counts = \d+.*$", f"accumulative_counts = {counts}"),
            (r"^save_steps = \d+.*$", f"save_steps = {save_steps}"),
            (
                r"^(from mmengine.optim import .*\n)",
                r"\g<1>from torch.optim import SGD\n" + KILL_HOOK,
            ),
        ],
    )
    path = tmp / f"{name}.py"
    path.write_text(text + SGD_STEP.format(lr=lr), encoding="utf-8")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(
    config: Path,
    work_dir: Path,
    *,
    nproc=1,
    deepspeed=None,
    kill_at=None,
    resume=None,
    options=(),
    status=None,
) -> str:
    """One real run; its output. ``kill_at``: SIGKILL after that iteration, or halfway
    through the write of that checkpoint (a name: ``"iter_8.pth"``). ``status``: the exit
    status expected of a one-process run (0, or -9 when killed, by default)."""
    env = dict(sc.venv_env(), PYTHONPATH=os.pathsep.join([str(SUPPORT), str(REPO)]))
    env.pop("XTUNER_ROPE_SIGKILL_AT", None)
    env.pop("XTUNER_ROPE_SIGKILL_IN_WRITE", None)
    if isinstance(kill_at, str):  # a checkpoint's name: killed halfway through its write
        env["XTUNER_ROPE_SIGKILL_IN_WRITE"] = kill_at
    elif kill_at:
        env["XTUNER_ROPE_SIGKILL_AT"] = str(kill_at)
    if nproc == 1:  # returns the child's status (-9 when killed)
        cmd = [sys.executable, "-m", "xtuner.tools.train", str(config)]
    else:  # XTuner's launcher (torchrun), as on a GPU node
        cmd = ["xtuner", "train", str(config), "--launcher", "pytorch"]
        env.update(NPROC_PER_NODE=str(nproc), NNODES="1", PORT=str(_free_port()))
    if deepspeed:
        cmd += ["--deepspeed", deepspeed]
    if resume:
        cmd += ["--resume", str(resume)]
    cmd += ["--work-dir", str(work_dir)]
    if options:
        cmd += ["--cfg-options", *options]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    if nproc == 1:
        expected = status if status is not None else (-9 if kill_at else 0)
        assert proc.returncode == expected, output[-4000:]
    return output


def _parameters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's parameters in an MMEngine ``.pth`` or a DeepSpeed checkpoint directory
    (ZeRO-3: the trainable ones, gathered from the ranks' shards by DeepSpeed's zero_to_fp32)."""
    if checkpoint.is_dir() and any(checkpoint.glob("zero_pp_rank_*_model_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), checkpoint.name)
    elif checkpoint.is_dir():
        state = torch.load(checkpoint / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    else:
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {
        k.removeprefix("module."): v.float()
        for k, v in state.items()
        if not k.removeprefix("module.").startswith("ref_llm.")  # DPO's frozen reference
    }


def _relative(a: dict, b: dict) -> float:
    """Largest relative difference over the tensors: max |a - b| / max |a|."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a)


def _straight(config: Path, work_dir: Path, *, iters: int, **run) -> dict[str, torch.Tensor]:
    """The uninterrupted run; its final parameters. Its log names the interval fix."""
    out = _run(config, work_dir, **run)
    assert "xtuner-rope: default_hooks.checkpoint.interval:" in out, out[-4000:]
    final = check_run(work_dir, min_iters=iters).checkpoint
    assert final.name == f"iter_{iters}.pth", final
    return _parameters(final)


def _kill_and_resume(
    config: Path, work_dir: Path, *, iters: int, counts: int, kill_at: int, **run
) -> dict[str, torch.Tensor]:
    """Killed by SIGKILL after ``kill_at`` (mid-window), resumed from its newest checkpoint;
    the final parameters of the resumed run."""
    out = _run(config, work_dir, kill_at=kill_at, **run)
    done, _ = train_losses(work_dir)
    assert done and done[-1] == kill_at, (done, out[-4000:])  # it died right there
    newest = (work_dir / "last_checkpoint").read_text().strip()
    boundary = kill_at // counts * counts
    assert Path(newest).name == f"iter_{boundary}.pth", newest  # aligned: not iter_{kill_at}
    verdict = judge_checkpoint(newest)  # a DeepSpeed folder: every rank's files, whole
    assert verdict.complete, verdict

    out = _run(config, work_dir, resume=newest, **run)
    assert re.search(rf"resumed epoch: \d+, iter: {boundary}", out), out[-4000:]
    resumed = check_run(work_dir, min_iters=iters).checkpoint
    assert resumed.name == f"iter_{iters}.pth", resumed
    return _parameters(resumed)


def _resume_from(
    straight: Path, config: Path, work_dir: Path, counts: int, kill_at: int, run: dict
) -> dict[str, torch.Tensor]:
    """``--resume`` from the uninterrupted run's checkpoint at the window boundary before
    ``kill_at`` (the checkpoint a run killed there resumes from), into a new work dir; the
    final parameters of the resumed run."""
    boundary = kill_at // counts * counts
    checkpoint = straight / f"iter_{boundary}.pth"
    verdict = judge_checkpoint(str(checkpoint))  # a DeepSpeed folder: every rank's files, whole
    assert verdict.complete, verdict
    run = dict(run)
    iters = run.pop("iters")
    out = _run(config, work_dir, resume=checkpoint, **run)
    assert re.search(rf"resumed epoch: \d+, iter: {boundary}", out), out[-4000:]
    resumed = check_run(work_dir, min_iters=iters).checkpoint
    assert resumed.name == f"iter_{iters}.pth", resumed
    return _parameters(resumed)


LOG_EVERY_ITER = ("default_hooks.logger.interval=1", "log_processor.window_size=1")
SFT_DIALOGUES, DPO_PAIRS = 32, 42  # 42 pairs pack into 16 rows of <= 400 tokens (1-5 pairs)


def _data(tmp: Path, source: str, n: int) -> Path:
    lines = (REPO / "data" / source).read_text(encoding="utf-8").splitlines()
    path = tmp / f"first_{n}_{source}"
    path.write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")
    return path


# LoRA with dropout on every linear layer, as XTuner's stock LoRA configs (lora_dropout 0.05-0.1):
# each iteration draws masks from the random stream, which a resume must continue, not restart.
LORA = """    lora=dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout=0.1, bias="none",
              task_type="CAUSAL_LM"),
"""


def _sft_config(tmp: Path, batch_size: int, lora: bool = False) -> Path:
    """The tiny recipe, accumulation 4, save_steps 3, a fixed order of 32 dialogues; ``lora``:
    a LoRA adapter with dropout (the frozen model's output then depends on the random stream)."""
    edits = [
        (r"^batch_size = \d+", f"batch_size = {batch_size}"),
        (r'^data_path = ".*"$', f'data_path = "{_data(tmp, "short_dialogues.jsonl", 32)}"'),
        (
            r"sampler=dict\(type=DefaultSampler, shuffle=True\)",
            "sampler=dict(type=DefaultSampler, shuffle=False)",
        ),
    ]
    if lora:
        edits += [
            (r"^(import torch\n)", r"\g<1>from peft import LoraConfig\n"),
            (r"^(    use_activation_checkpointing=False,\n)", r"\g<1>" + LORA),
        ]
    text = _edit(
        (REPO / "configs" / "tiny_internlm2_short_dialogues.py").read_text(encoding="utf-8"), edits
    )
    name = f"sft_{batch_size}" + ("_lora" if lora else "")
    return _recipe(tmp, name, text, counts=4, save_steps=3, lr=0.1 if not lora else 1.0)


# The DPO recipe as XTuner's ORPO (its stock ORPO config differs from the DPO one by the model
# alone: the same pairs, ``is_dpo=True``, packing) and the reward-model recipe.
ORPO_EDITS = [
    (r"^from xtuner.model.dpo import DPO$", "from xtuner.model.orpo import ORPO"),
    (r"^    type=DPO,.*$", "    type=ORPO,"),
    (r"^    loss_type=dpo_loss_type,\n", ""),
    (r"^    label_smoothing=label_smoothing,\n", ""),
]
PAIR_RECIPES = {
    "dpo": ("tiny_internlm2_dpo_pairs.py", []),
    "orpo": ("tiny_internlm2_dpo_pairs.py", ORPO_EDITS),
    "reward": ("tiny_internlm2_reward_pairs.py", []),
}


def _pairs_config(tmp: Path, counts: int, model: str = "dpo") -> Path:
    """The DPO, ORPO or reward-model pairs recipe, 16 packed rows in a fixed order,
    accumulation ``counts``."""
    recipe, edits = PAIR_RECIPES[model]
    text = _edit(
        (REPO / "configs" / recipe).read_text(encoding="utf-8"),
        [
            *edits,
            (r'^data_path = ".*"$', f'data_path = "{_data(tmp, "preference_pairs.jsonl", 42)}"'),
            (r"^max_packed_length = .*$", "max_packed_length = 400"),
            (r"^max_epochs = \d+.*$", "max_epochs = 1"),
            (r"shuffle_before_pack=True", "shuffle_before_pack=False"),
            (
                r"sampler=dict\(type=DefaultSampler, shuffle=True\)",
                "sampler=dict(type=DefaultSampler, shuffle=False)",
            ),
        ],
    )
    return _recipe(tmp, f"{model}_{counts}", text, counts=counts, save_steps=3, lr=1.0)


# name: (config builder argument, processes, DeepSpeed, iterations, accumulation, kill after)
SCENARIOS = {
    "sft-plain": ("sft", 4, 1, None, 8, 4, 6),
    "sft-zero2": ("sft", 2, 2, ZERO2, 8, 4, 6),
    "sft-zero1": ("sft", 2, 2, "zero1", 8, 4, 6),
    "sft-lora-dropout": ("sft-lora", 4, 1, None, 8, 4, 6),
    "sft-lora-dropout-zero2": ("sft-lora", 2, 2, ZERO2, 8, 4, 6),
    "sft-lora-dropout-zero3": ("sft-lora", 2, 2, ZERO3, 8, 4, 6),
    "dpo-plain": ("dpo", 8, 1, None, 16, 8, 12),
    "dpo-zero2": ("dpo", 4, 2, ZERO2, 8, 4, 6),
}
# By hand (not in CI: minutes each): XTUNER_ROPE_RESUME_BY_HAND=1 adds these.
BY_HAND = {
    "sft-lora-dropout-ddp": ("sft-lora", 2, 2, None, 8, 4, 6),
    "sft-lora-dropout-zero1": ("sft-lora", 2, 2, "zero1", 8, 4, 6),
    "orpo-zero2": ("orpo", 4, 2, ZERO2, 8, 4, 6),
    "reward-zero2": ("reward", 4, 2, ZERO2, 8, 4, 6),
}
RESUME_BY_HAND = os.environ.get("XTUNER_ROPE_RESUME_BY_HAND") == "1"
if RESUME_BY_HAND:
    SCENARIOS.update(BY_HAND)
# Scenarios whose uninterrupted run stays in CI (the tests below share it) but whose kill and
# resume is by hand: CI proves the same with the same recipe elsewhere. sft-plain: the
# checkpoint-write test kills it, resumes from iter_4 and ends equal to the uninterrupted run;
# sft-zero2: sft-lora-dropout-zero2 (the same recipe and ZeRO-2 json) and dpo-zero2 (all
# parameters). About 65 s less in CI (dpo-plain: about 40 s more).
# dpo-plain: the DPO pairs' kill and resume is dpo-zero2's, the plain optimizer's resume
# sft-lora-dropout's, the one-process kill test_stock_config_killed_and_resumed's (its
# uninterrupted run stays: the 1-vs-2-process DPO step reads it).
# sft-zero1: its uninterrupted run is the 1-vs-2-process step's ZeRO-1 row and the ZeRO-1
# conversion's checkpoint; its kill and resume is sft-zero2's with stage 1 (by hand).
KILLED_BY_HAND = ("sft-plain", "sft-zero2", "sft-zero1", "dpo-plain")
KILLED = [n for n in SCENARIOS if RESUME_BY_HAND or n not in KILLED_BY_HAND]
# Scenarios whose CI run resumes from the uninterrupted run's own window-boundary checkpoint
# (``iter_4.pth``, the one the killed run would resume from: the same deterministic run up to
# there, written before the kill) instead of killing a third run: the kill itself is proven
# on 2 processes under ZeRO-2 by dpo-zero2 and on one process (killed mid-window, resumed from
# the aligned checkpoint) by test_stock_config_killed_and_resumed, and what these scenarios
# add, the random state of LoRA dropout restored on one process and under ZeRO-2 and ZeRO-3,
# is proven by the resume alone. One run less each (about 60 s of CI for each 2-process one,
# about 15 s for sft-lora-dropout). By hand (``XTUNER_ROPE_RESUME_BY_HAND=1``) they are killed
# too.
RESUMED_FROM_STRAIGHT = (
    ()
    if RESUME_BY_HAND
    else ("sft-lora-dropout", "sft-lora-dropout-zero2", "sft-lora-dropout-zero3")
)
KEEP_EVERY_CHECKPOINT = ("default_hooks.checkpoint.max_keep_ckpts=-1",)
_STRAIGHT: dict[str, dict] = {}  # scenario -> uninterrupted parameters, shared by the tests
_STRAIGHT_DIR: dict[str, Path] = {}  # scenario -> the uninterrupted run's work dir


def _setup(name: str, tmp: Path) -> tuple[Path, dict]:
    recipe, arg, nproc, deepspeed, iters, counts, kill_at = SCENARIOS[name]
    tmp.mkdir(parents=True, exist_ok=True)
    if recipe.startswith("sft"):
        config = _sft_config(tmp, arg, lora=recipe == "sft-lora")
    else:
        config = _pairs_config(tmp, arg, recipe)
    if deepspeed == "zero1":  # the ZeRO-2 json at stage 1
        zero1 = tmp / "zero1.json"
        zero1.write_text(
            (REPO / ZERO2).read_text(encoding="utf-8").replace('"stage": 2', '"stage": 1')
        )
        deepspeed = str(zero1)
    run = dict(iters=iters, nproc=nproc, deepspeed=deepspeed, options=LOG_EVERY_ITER)
    return config, run


def _uninterrupted(name: str, tmp: Path) -> dict[str, torch.Tensor]:
    if name not in _STRAIGHT:
        config, run = _setup(name, tmp)
        if name in RESUMED_FROM_STRAIGHT:  # its boundary checkpoint is resumed from
            run["options"] = run["options"] + KEEP_EVERY_CHECKPOINT
        _STRAIGHT[name] = _straight(config, tmp / "straight", **run)
        _STRAIGHT_DIR[name] = tmp / "straight"
    return _STRAIGHT[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", KILLED)
def test_killed_mid_window_and_resumed_equals_uninterrupted(name, tmp_path):
    straight = _uninterrupted(name, tmp_path)
    config, run = _setup(name, tmp_path)
    _, _, _, _, _, counts, kill_at = SCENARIOS[name]
    if name in RESUMED_FROM_STRAIGHT:
        resumed = _resume_from(
            _STRAIGHT_DIR[name], config, tmp_path / "resumed", counts, kill_at, run
        )
    else:
        resumed = _kill_and_resume(
            config, tmp_path / "killed", counts=counts, kill_at=kill_at, **run
        )
    difference = _relative(straight, resumed)
    print(f"{name}: resumed vs uninterrupted, parameters {difference:.1e} relative")
    assert difference <= RESUME_RTOL, difference


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sft", "dpo"])
def test_two_processes_zero2_step_equals_one_process(recipe, tmp_path):
    """Same micro-batches per step on 1 process (plain) and 2 (ZeRO-2): the token-weighted
    (SFT) and pair-weighted (DPO) steps agree. For SFT also ZeRO-1 (one more run)."""
    plain = _uninterrupted(f"{recipe}-plain", tmp_path / "plain")
    zero2 = _uninterrupted(f"{recipe}-zero2", tmp_path / "zero2")
    figures = {"ZeRO-2": _relative(plain, zero2)}
    if recipe == "sft":  # the ZeRO-2 json at stage 1 (shared with the ZeRO-1 conversion)
        figures["ZeRO-1"] = _relative(plain, _uninterrupted("sft-zero1", tmp_path / "zero1"))
    print(f"{recipe}: 2 processes vs 1, parameters relative: {figures}")
    for strategy, difference in figures.items():
        assert difference <= STRATEGY_RTOL, (strategy, difference)


def _killed_in_write(name: str, tmp: Path, kill_at: str, folder: str):
    """Scenario ``name`` SIGKILLed inside the write of ``kill_at`` (``iter_8.pth`` or a file
    of its DeepSpeed folder) after its last iteration: ``iter_4.pth`` complete and named by
    ``last_checkpoint``. Returns the uninterrupted parameters, the config, the run arguments
    and the killed run's work dir."""
    straight = _uninterrupted(name, tmp)
    config, run = _setup(name, tmp)
    run.pop("iters")
    work = tmp / folder
    _run(config, work, kill_at=kill_at, **run)
    done, _ = train_losses(work)
    assert done and done[-1] == 8, done  # the last iteration ran; its checkpoint did not land
    kept = work / "iter_4.pth"
    assert judge_checkpoint(str(kept)).complete
    assert (work / "last_checkpoint").read_text().strip() == str(kept)
    return straight, config, run, work


def _auto_resumed(config: Path, work: Path, run: dict, straight: dict) -> tuple[str, float]:
    """``resume = True`` in the killed run's work dir: resumed from ``iter_4.pth``, a complete
    ``iter_8.pth``; the output and the relative difference to the uninterrupted run."""
    out = _run(config, work, **dict(run, options=(*LOG_EVERY_ITER, "resume=True")))
    assert re.search(r"resumed epoch: \d+, iter: 4", out), out[-4000:]
    resumed = check_run(work, min_iters=8).checkpoint
    assert resumed.name == "iter_8.pth" and judge_checkpoint(str(resumed)).complete
    return out, _relative(straight, _parameters(resumed))


@pytest.mark.slow
def test_killed_during_a_checkpoint_write_and_auto_resumed_equals_uninterrupted(tmp_path):
    """The tiny recipe (sft-plain) SIGKILLed halfway through writing ``iter_8.pth``, its last
    checkpoint (``tests/support/sigkill_hook.py``): ``iter_4.pth`` complete and named by
    ``last_checkpoint``, nothing incomplete under a checkpoint's name; ``resume = True`` resumes
    from ``iter_4.pth``, removes the dead writer's temporary and ends equal to the
    uninterrupted run. Without the atomic write MMEngine leaves half of ``iter_8.pth`` under
    its name (and with ``max_keep_ckpts = 1`` deletes ``iter_4.pth`` before the write)."""
    straight, config, run, work = _killed_in_write(
        "sft-plain", tmp_path, "iter_8.pth", "killed_in_write"
    )
    assert not (work / "iter_8.pth").exists()  # the final name holds a whole checkpoint or none
    (temporary,) = work.glob(".iter_8.pth.*.tmp")  # the killed write's half, under its own name
    print(f"killed in the write of iter_8.pth: {temporary.stat().st_size} bytes out")

    _, difference = _auto_resumed(config, work, run, straight)
    assert not list(work.glob(".*.tmp"))  # the dead writer's temporary is gone
    print(f"killed in a write, auto-resumed vs uninterrupted: {difference:.1e} relative")
    assert difference <= RESUME_RTOL, difference


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("XTUNER_ROPE_RESUME_BY_HAND") != "1",
    reason="opt-in (3 runs of 2 processes, minutes): XTUNER_ROPE_RESUME_BY_HAND=1",
)
def test_killed_while_deepspeed_writes_its_folder_refused_and_auto_resumed(tmp_path):
    """The sft-zero2 scenario (2 processes, ZeRO-2) with rank 1 SIGKILLed halfway through its
    optimizer file of ``iter_8.pth/`` (rank 0's model and optimizer files out, the final
    barrier and ``last_checkpoint`` never reached): the folder is judged incomplete;
    ``--resume`` of it is refused before any iteration, naming it and ``iter_4.pth``;
    ``resume = True`` skips it with a warning, resumes from ``iter_4.pth`` and ends equal to
    the uninterrupted run (shared with the scenario)."""
    rank_1_file = "iter_8.pth/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    straight, config, run, work = _killed_in_write(
        "sft-zero2", tmp_path, rank_1_file, "killed_in_folder"
    )
    folder, kept = work / "iter_8.pth", work / "iter_4.pth"
    verdict = judge_checkpoint(str(folder))
    print(f"killed in DeepSpeed's write of iter_8.pth/: {verdict.reason}")
    assert folder.is_dir() and not verdict.complete

    refused = _run(config, tmp_path / "refused", resume=folder, **run)
    assert f"refused to load {folder}: the checkpoint is incomplete" in refused, refused[-4000:]
    assert f"resume with --resume {kept}" in refused
    assert not train_losses(tmp_path / "refused")[0]  # not one iteration

    out, difference = _auto_resumed(config, work, run, straight)
    assert f"auto-resume: skipped {folder}, newer than {kept} but incomplete" in out, out[-4000:]
    print(f"killed in a DeepSpeed write, auto-resumed vs uninterrupted: {difference:.1e} relative")
    assert difference <= RESUME_RTOL, difference


def _documents(work: Path, world: int, iters: range) -> list[str]:
    """The documents the runs of ``world`` processes trained in ``iters`` (every rank's)."""
    found = []
    for path in sorted(work.glob("documents_rank*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record["world"] == world and record["iter"] in iters:
                found += record["docs"]
    return found


@pytest.mark.slow
def test_plain_checkpoint_of_two_processes_resumed_on_one(tmp_path):
    """The tiny recipe on 2 processes (DDP, batch 2 each, 16 dialogues a step), SIGKILLed
    after iteration 6, resumed from ``iter_4.pth`` on 1 process: it resumes and trains to the
    end of its epoch (16 iterations of 2), and the log says how the data order changes; which
    dialogues are trained twice is measured (``RecordDocumentsHook``) and equals the log's
    account: the 2 processes trained items 1-16 of the sampler's order in 4 iterations, the
    resume skips 4 batches of 2, items 1-8, so items 9-16 are trained a second time."""
    config = _sft_config(tmp_path, 2)
    text = config.read_text(encoding="utf-8")
    text = sc.sub_once(
        text,
        r"^(from torch.optim import SGD\n)",
        r"\g<1>from record_documents_hook import RecordDocumentsHook\n",
    )
    config.write_text(text + "custom_hooks.append(dict(type=RecordDocumentsHook))\n")
    work = tmp_path / "ddp_then_one"
    _run(config, work, nproc=2, kill_at=6, options=LOG_EVERY_ITER)
    newest = Path((work / "last_checkpoint").read_text().strip())
    assert newest.name == "iter_4.pth" and newest.is_file(), newest  # plain: one file

    out = _run(config, work, resume=newest, options=LOG_EVERY_ITER)
    assert re.search(r"resumed epoch: \d+, iter: 4", out), out[-4000:]
    assert "it was written by 2 process(es), this run has 1. The data order changes" in out
    assert "items 9-16 of the order are trained a second time (8 of 32)" in out, out[-4000:]
    assert check_run(work, min_iters=16).checkpoint.name == "iter_16.pth"
    before = _documents(work, 2, range(1, 5))  # in iter_4.pth: 4 iterations x 2 ranks x 2
    after = _documents(work, 1, range(5, 17))  # the resumed run's 12 iterations x 2
    assert len(before) == 16 and len(after) == 24, (len(before), len(after))
    twice = set(before) & set(after)
    print(
        f"2 -> 1 processes: {len(twice)} dialogues trained twice, "
        f"{32 - len(set(before) | set(after))} never, of 32"
    )
    assert len(twice) == 8 and len(set(before) | set(after)) == 32


@pytest.mark.slow
def test_zero_checkpoint_on_another_number_of_processes_refused_before_loading(tmp_path):
    """The sft-zero2 scenario's uninterrupted ``iter_8.pth/`` (2 processes) resumed on one:
    refused while XTuner reads the seed, before anything is built (no log folder), naming both
    numbers of processes and the commands that work."""
    _uninterrupted("sft-zero2", tmp_path)
    checkpoint = _STRAIGHT_DIR["sft-zero2"] / "iter_8.pth"
    config, _ = _setup("sft-zero2", tmp_path / "refused_setup")
    work = tmp_path / "refused"
    out = _run(config, work, deepspeed=ZERO2, resume=checkpoint, status=1)
    assert "WorldSizeMismatchError" in out, out[-4000:]
    assert (
        f"refused to resume {checkpoint}: it is a DeepSpeed ZeRO-2 checkpoint written by 2" in out
    )
    assert "and this run has 1 (WORLD_SIZE=1)" in out
    assert "NPROC_PER_NODE=2 xtuner train CONFIG --launcher pytorch" in out
    assert f"python -m deepspeed.utils.zero_to_fp32 {checkpoint.parent}" in out
    assert not list(work.glob("2*")), "something was built"  # MMEngine's timestamped log dir


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft-zero1", "sft-zero2", "sft-lora-dropout-zero3"])
def test_zero_checkpoint_converted_bit_for_bit(name, tmp_path):
    """The scenario's uninterrupted ``iter_8.pth/`` (2 processes; shared): XTuner's
    ``guess_load_checkpoint`` (patched) reads the weights DeepSpeed saved bit for bit (ZeRO-1
    and ZeRO-2: the module of ``mp_rank_00_model_states.pt``; ZeRO-3: DeepSpeed's
    ``zero_to_fp32``), where
    xtuner 0.2.0's fp16 read gives ``module.half()``; ``xtuner-rope convert pth_to_hf`` saves
    them bit for bit with ``--fp32`` and by default (the run trained in fp32), and with
    ``--dtype bf16`` their bf16 cast, counted. LoRA (ZeRO-3): the adapter, and ``xtuner-rope
    convert merge --dtype fp32`` of it: the module with its adapter within fp32 rounding."""
    import converted

    _uninterrupted(name, tmp_path)
    checkpoint = _STRAIGHT_DIR[name] / "iter_8.pth"
    reference = converted.deepspeed_weights(checkpoint)
    read = converted.read_as_xtuner(checkpoint)
    assert read and not converted.unequal(read, reference)
    as_xtuner = converted.read_as_xtuner(checkpoint, torch.float16)  # xtuner 0.2.0's default
    assert not converted.unequal(as_xtuner, reference, torch.float16)
    off = max((as_xtuner[k].float() - reference[k]).abs().max().item() for k in read)
    print(f"{name}: read as xtuner 0.2.0 does (fp16) {off:.1e} off the weights DeepSpeed saved")
    assert off > 0

    config, _ = _setup(name, tmp_path / "convert_setup")
    trained = {k: v for k, v in read.items() if "lora_" in k or not name.startswith("sft-lora")}
    for n, (options, dtype, said) in enumerate(
        [
            (["--fp32"], torch.float32, "saving in fp32 (asked)"),
            (
                [],
                torch.float32,
                f"saving in fp32 (the dtype of the trained weights in {checkpoint}",
            ),
            (["--dtype", "bf16"], torch.bfloat16, "saving in bf16 (asked)"),
        ]
    ):
        printed = converted.convert(config, checkpoint, tmp_path / f"hf_{n}", *options)
        saved = converted.saved_weights(tmp_path / f"hf_{n}")
        assert saved.keys() == trained.keys(), sorted(saved.keys() ^ trained.keys())[:5]
        assert not converted.unequal(saved, reference, dtype), options
        assert said in printed and "no value overflowed to inf or was flushed" in printed, printed
    if name.startswith("sft-lora"):  # the adapter merged in fp32 vs the module with it
        merged = converted.merged_against_module(
            config, tmp_path / "hf_0", reference, tmp_path / "m"
        )
        print(f"{name}: convert merge --dtype fp32 vs the module with its adapter: {merged}")
        assert merged["weights"] == 0  # = peft's fp32 merge of the module, bit for bit
        assert merged["logits"] <= 1e-5 * merged["largest"] < merged["adapter"]


STOCK = "internlm2_chat_1_8b_full_alpaca_e3"


@pytest.mark.slow
def test_stock_config_killed_and_resumed(tmp_path):
    """``xtuner copy-cfg`` of a stock config (its save_steps 500 is no multiple of its
    accumulative_counts 16 either), localized, accumulation 4 and save_steps 6: aligned to 8;
    killed after iteration 10, resumed from iter_8, equal to the uninterrupted 12 iterations."""
    sc.ensure_tiny_model()
    text = sc.enable_plugin(
        sc.localize(sc.copy_stock(STOCK, tmp_path), sc.write_alpaca_data(tmp_path / "alpaca"))
    )
    config = _recipe(tmp_path, "stock", text, counts=4, save_steps=6, lr=0.1)
    options = (
        "train_cfg.max_epochs=None",
        "train_cfg.max_iters=12",
        "randomness.seed=0",
        *LOG_EVERY_ITER,
    )
    straight = _straight(config, tmp_path / "straight", iters=12, options=options)
    resumed = _kill_and_resume(
        config, tmp_path / "killed", iters=12, counts=4, kill_at=10, options=options
    )
    difference = _relative(straight, resumed)
    print(f"stock {STOCK}: resumed vs uninterrupted, parameters {difference:.1e} relative")
    assert difference <= RESUME_RTOL, difference


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("XTUNER_ROPE_RESUME_BY_HAND") != "1",
    reason="opt-in (3 runs of 2 processes, minutes): XTUNER_ROPE_RESUME_BY_HAND=1",
)
def test_sequence_parallel_2_killed_and_resumed(tmp_path):
    """The stock config with ``sequence_parallel_size = 2`` (its ``SequenceParallelSampler``,
    its ``accumulative_counts *= sequence_parallel_size``: 2 x 2 = 4), ZeRO-2 on 2 processes
    forming one sequence-parallel group (each row split between them); save_steps 3 (aligned
    to 4), killed after iteration 6, resumed from iter_4, equal to the uninterrupted 8."""
    sc.ensure_tiny_model()
    text = sc.enable_plugin(
        sc.localize(sc.copy_stock(STOCK, tmp_path), sc.write_alpaca_data(tmp_path / "alpaca"))
    )
    text = sc.sub_once(text, r"^sequence_parallel_size = 1$", "sequence_parallel_size = 2")
    config = _recipe(tmp_path, "stock_sp2", text, counts=2, save_steps=3, lr=0.1)
    options = (
        "train_cfg.max_epochs=None",
        "train_cfg.max_iters=8",
        "randomness.seed=0",
        *LOG_EVERY_ITER,
    )
    run = dict(iters=8, nproc=2, deepspeed=ZERO2, options=options)
    straight = _straight(config, tmp_path / "straight", **run)
    resumed = _kill_and_resume(config, tmp_path / "killed", counts=4, kill_at=6, **run)
    difference = _relative(straight, resumed)
    print(f"sequence parallel 2: resumed vs uninterrupted, parameters {difference:.1e} relative")
    assert difference <= RESUME_RTOL, difference


LLAVA_LORA = "llava_vicuna_7b_v15_qlora_clip_vit_large_p14_336_lora_e1_gpu8_finetune"
LLAVA_RESUME = os.environ.get("XTUNER_ROPE_LLAVA_RESUME") == "1"
BY_HAND_RESUME = os.environ.get("XTUNER_ROPE_RESUME_BY_HAND") == "1"


def _llava_config(tmp: Path, name: str) -> Path:
    """Issue 40's LLaVA configs on a tiny CLIP, 4 loader workers (the stock number), packed by
    ``llava_collate_fn``: the Vicuna LoRA finetune on a tiny Llama (LoRA dropout 0.05 on the
    LLM and CLIP) or the InternLM2 pretrain (LLM and CLIP frozen, the projector trained)."""
    import llava_configs as lc

    from xtuner_rope.demo.tiny import save_tiny

    assets = lc.llava_assets(tmp / "assets")
    if name == "llava-lora-finetune":
        llm = save_tiny(tmp / "assets" / "tiny-llama", "llama", sc.SAMPLE_DATA)
        stock = sc.copy_stock(LLAVA_LORA, tmp)
    else:
        llm, stock = assets["llm"], assets["pretrain"]
    text = lc.localize_llava(stock, llm, assets["clip"], assets["data"])
    text = sc.sub_once(text, r"^dataloader_num_workers = 0$", "dataloader_num_workers = 4")
    return _recipe(
        tmp, name, lc.enable_plugin_llava(lc.with_llava_collate(text)), counts=4, save_steps=2,
        lr=0.1,
    )  # fmt: skip


def _internvl_config(tmp: Path, name: str) -> Path:
    """The stock InternVL configs of ``test_internvl.py`` with 4 loader workers: the Phi-3
    full finetune packed by ``internvl_collate_fn``, the InternLM2 LoRA (dropout 0.05) padded."""
    import internvl_configs as ic

    assets = ic.internvl_assets(tmp / "assets")
    stock, model = (
        (ic.PHI3_FULL, "phi3") if name == "internvl-full" else (ic.INTERNLM2_LORA, "internlm2")
    )
    text = ic.localize_internvl(assets[stock], assets[model], assets["data"])
    text = sc.sub_once(text, r"^dataloader_num_workers = 0$", "dataloader_num_workers = 4")
    text = ic.enable_plugin_internvl(text)
    if name == "internvl-full":
        text = ic.with_internvl_collate(text)
    return _recipe(tmp, name, text, counts=4, save_steps=2, lr=0.1)


# Multimodal scenarios (1 process, accumulation 4, save_steps 2 aligned to 4, 12 iterations,
# killed after 7, resumed from iter_4): opt-in, minutes each on 2 cores.
MULTIMODAL = {
    "llava-lora-finetune": (_llava_config, LLAVA_RESUME or BY_HAND_RESUME),
    "llava-pretrain": (_llava_config, BY_HAND_RESUME),
    "internvl-full": (_internvl_config, BY_HAND_RESUME),
    "internvl-lora": (_internvl_config, BY_HAND_RESUME),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                not wanted,
                reason="opt-in (5-10 minutes on 2 cores): XTUNER_ROPE_RESUME_BY_HAND=1"
                + (" or XTUNER_ROPE_LLAVA_RESUME=1" if name == "llava-lora-finetune" else ""),
            ),
        )
        for name, (_, wanted) in MULTIMODAL.items()
    ],
)
def test_multimodal_killed_and_resumed(name, tmp_path):
    """Issue 40's LLaVA and InternVL scenarios: killed after iteration 7, resumed from iter_4,
    equal to the uninterrupted 12 iterations. Without the restored random state the LoRA
    dropout masks of iterations 5-12 differ (LLaVA LoRA: measured 1.2e-2 by the issue)."""
    config = MULTIMODAL[name][0](tmp_path, name)
    options = (
        "train_cfg.max_epochs=None",
        "train_cfg.max_iters=12",
        "randomness.seed=0",
        *LOG_EVERY_ITER,
    )
    straight = _straight(config, tmp_path / "straight", iters=12, options=options)
    # The stock InternVL configs set save_optimizer=False: the start-up turns it on (without
    # it the optimizer restarts on resume: measured 4.0e-1 full, 1.1e0 LoRA).
    saved = torch.load(
        tmp_path / "straight" / "iter_12.pth", map_location="cpu", weights_only=False
    )
    assert "optimizer" in saved, sorted(saved)
    resumed = _kill_and_resume(
        config, tmp_path / "killed", iters=12, counts=4, kill_at=7, options=options
    )
    difference = _relative(straight, resumed)
    print(f"{name}: resumed vs uninterrupted, parameters {difference:.1e} relative")
    assert difference <= RESUME_RTOL, difference
