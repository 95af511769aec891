"""Launch settings refused by the start-up before a weight is loaded (``launch_findings``).

XTuner's stock ``deepspeed_zero2`` resolves to fp16 on a CPU-only machine (DeepSpeed then
raises after the model is built); ``InternRepoSampler`` on several processes without DeepSpeed
fails when the dataloader is built. The real ``xtuner train`` with ``--deepspeed
deepspeed_zero2`` must stop at the start-up with the edit.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config

from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.launch import (
    LAUNCHER_ENV,
    deepspeed_argument,
    deepspeed_dtype_findings,
    sampler_findings,
    single_process_deepspeed_findings,
)
from xtuner_rope.config.startup import prepare_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "tiny_internlm2_short_dialogues.py"
TRAIN = "/site-packages/xtuner/tools/train.py"

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is fine on a GPU")


def _cfg(**kw) -> Config:
    return Config(dict(train_dataloader=dict(sampler=dict(type="DefaultSampler")), **kw))


def test_deepspeed_argument_is_read_only_inside_xtuner_train():
    assert (
        deepspeed_argument([TRAIN, "c.py", "--deepspeed", "deepspeed_zero2"]) == "deepspeed_zero2"
    )
    assert deepspeed_argument([TRAIN, "c.py", "--deepspeed=x.json"]) == "x.json"
    assert deepspeed_argument(["xtuner-rope", "doctor", "--deepspeed", "x.json"]) is None
    assert deepspeed_argument([TRAIN, "c.py"]) is None


@cpu_only
def test_stock_deepspeed_zero2_on_cpu_is_refused_with_the_fp32_settings(monkeypatch):
    monkeypatch.setattr(sys, "argv", [TRAIN, "c.py", "--deepspeed", "deepspeed_zero2"])
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)--deepspeed: deepspeed_zero2 \(.*\) resolves to "
        r"fp16 on this CPU-only machine.*Type fp16 is not "
        r"supported.*pass --deepspeed .*zero2_fp32_cpu\.json",
    ) as refused:
        prepare_config(_cfg())
    fp32 = str(REPO / "configs/deepspeed/zero2_fp32_cpu.json")
    assert f"pass --deepspeed {fp32} " in str(refused.value)  # absolute: works from any cwd
    assert deepspeed_dtype_findings(_cfg(), [TRAIN, "c.py", "--deepspeed", fp32]) == []


@cpu_only
@pytest.mark.parametrize(
    "ds, dtype",
    [
        (dict(fp16=dict(enabled="auto"), zero_optimization=dict(stage=3)), "fp16"),
        (dict(bf16=dict(enabled=True)), "bf16"),
    ],
)
def test_strategy_config_with_half_precision_on_cpu_is_refused(ds, dtype):
    cfg = _cfg(strategy=dict(type="DeepSpeedStrategy", config=ds))
    stage = (ds.get("zero_optimization") or {}).get("stage", 2)
    with pytest.raises(
        ConfigConflict,
        match=rf"(?s)strategy.config: strategy.config resolves to "
        rf"{dtype} on this CPU-only machine.*"
        rf"zero{stage}_fp32_cpu\.json",
    ):
        prepare_config(cfg)


def test_intern_repo_sampler_on_two_processes_without_deepspeed_is_refused(monkeypatch):
    cfg = Config(dict(train_dataloader=dict(sampler=dict(type="InternRepoSampler"))))
    monkeypatch.setattr(sys, "argv", [TRAIN, "c.py"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)train_dataloader.sampler: InternRepoSampler "
        r"takes its rank from DeepSpeed's data-parallel "
        r"group.*on 2 processes.*run with --deepspeed",
    ):
        prepare_config(cfg)
    assert sampler_findings(cfg, argv=[TRAIN, "c.py"], world_size=1) == []
    assert (
        sampler_findings(cfg, argv=[TRAIN, "c.py", "--deepspeed", "deepspeed_zero2"], world_size=2)
        == []
    )


@cpu_only
@pytest.mark.slow
def test_xtuner_train_with_stock_zero2_stops_before_loading(tmp_path):
    """The real ``python -m xtuner.tools.train ... --deepspeed deepspeed_zero2``: refused by
    the start-up (exit 1), never reaching DeepSpeed's engine or the model."""
    sc.ensure_tiny_model()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xtuner.tools.train",
            str(RECIPE),
            "--work-dir",
            str(tmp_path),
            "--deepspeed",
            "deepspeed_zero2",
        ],
        cwd=REPO,
        env=sc.venv_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "resolves to fp16 on this CPU-only machine" in out, out[-3000:]
    assert "zero2_fp32_cpu.json" in out
    assert "ConfigConflict" in out and "ValueError: Type fp16" not in out


def test_one_process_deepspeed_gets_a_one_process_torchrun_environment():
    """``xtuner train CFG --deepspeed X`` without a launcher: DeepSpeed would look for MPI; the
    start-up's fix gives the process torchrun's variables (the real run: the SP = 1 reference of
    tests/integration/test_sequence_parallel_train.py)."""
    argv = [TRAIN, "c.py", "--deepspeed", "configs/deepspeed/zero2_fp32_cpu.json"]
    environ = {"MASTER_PORT": "29555"}
    (fix,) = single_process_deepspeed_findings(_cfg(), argv, environ)
    assert fix.setting == "--deepspeed without --launcher"
    assert "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR: DeepSpeed would look for MPI" in fix.problem
    fix.fix()
    assert environ == dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555"
    )
    assert single_process_deepspeed_findings(_cfg(), argv, environ) == []  # all set now
    full = dict.fromkeys(LAUNCHER_ENV, "0")
    for other in (argv + ["--launcher", "pytorch"], argv[:2], ["python", *argv[1:]]):
        assert single_process_deepspeed_findings(_cfg(), other, {}) == [], other
    assert single_process_deepspeed_findings(_cfg(), argv, full) == []
