"""What the zoo sweep found, refused by name: DeepSeek-V2, the warm-up rounding, ``--deepspeed``.

- XTuner's stock DeepSeek-V2 configs build ``DeepseekV2ForCausalLM`` from XTuner's own modeling
  package, which does not import with transformers 4.48: the start-up refuses the family from
  the config alone (no checkpoint is looked up).
- A warm-up that MMEngine's epoch-to-iteration conversion rounds to 0 iterations is refused with
  the setting, the dataset's length and the edit (the real run: the zoo sample,
  ``tests/zoo/test_zoo.py``).
- ``xtuner-rope doctor --deepspeed X`` inspects the config as ``xtuner train --deepspeed X``.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config

from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.launch import deepspeed_dtype_findings, launched_with
from xtuner_rope.config.startup import prepare_config
from xtuner_rope.config.warmup import refuse_rounded_warmup, rounding_problems

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "tiny_internlm2_short_dialogues.py"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is fine on a GPU")


def test_stock_deepseek_v2_is_refused_from_the_config_alone():
    from xtuner.configs import cfgs_name_path

    cfg = Config.fromfile(cfgs_name_path["deepseek_v2_lite_chat_full_alpaca_e3_32k_varlen"])
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)model\.llm\.type: xtuner\.model\."
        r"transformers_models\.deepseek_v2\.DeepseekV2ForCausalLM: DeepSeek-V2 "
        r"cannot be served by xtuner-rope: .*does not import here \(ImportError"
        r".*-> use a checkpoint of a served family",
    ):
        prepare_config(cfg)


def test_a_warmup_rounded_to_zero_iterations_is_refused_by_name():
    stock = [
        dict(type="LinearLR", begin=0, end=0.03, convert_to_iter_based=True),
        dict(type="CosineAnnealingLR", begin=0.03, end=1, convert_to_iter_based=True),
    ]
    with pytest.raises(
        ConfigConflict,
        match=r"(?s)param_scheduler\[0\]: LinearLR, begin=0, "
        r"end=0\.03 epochs.*becomes begin=0, end=0 iterations on this dataset "
        r"\(6 samples, batch size 1, 1 process\(es\): 6 iterations per epoch\)"
        r".*-> the warm-up must last at least 1 iteration: set warmup_ratio so "
        r"that warmup_ratio \* max_epochs >= 0\.167",
    ):
        refuse_rounded_warmup(stock, 6, "6 samples, batch size 1, 1 process(es)")
    assert rounding_problems(stock, 34, "34 samples") == []  # 1.02 iterations: trains
    refuse_rounded_warmup(stock, 34, "34 samples")


def test_the_warmup_check_runs_in_mmengines_runner():
    """The check sits right before MMEngine builds the schedulers (compat, version-guarded)."""
    from mmengine.runner import Runner

    import xtuner_rope
    from xtuner_rope import compat

    xtuner_rope.activate()  # applies compat

    assert "patch_mmengine_warmup_rounding" in compat.applied()
    assert Runner._build_param_scheduler.__code__.co_filename.endswith("mmengine_scheduler.py")


@cpu_only
def test_launched_with_gives_the_start_up_the_deepspeed_argument():
    cfg = Config(dict(train_dataloader=dict(sampler=dict(type="DefaultSampler"))))
    assert deepspeed_dtype_findings(cfg) == []
    with launched_with("deepspeed_zero2"):
        (finding,) = deepspeed_dtype_findings(cfg)
    assert finding.setting == "--deepspeed" and "resolves to fp16" in finding.problem
    assert deepspeed_dtype_findings(cfg) == []  # only inside


@cpu_only
def test_doctor_names_the_deepspeed_dtype_on_cpu(tmp_path):
    sc.ensure_tiny_model()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xtuner_rope.cli",
            "doctor",
            str(RECIPE),
            "--deepspeed",
            "deepspeed_zero2",
            "--batches",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env=sc.venv_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "--deepspeed: deepspeed_zero2" in out and "resolves to fp16 on this CPU-only" in out
    assert "zero2_fp32_cpu.json" in out


def test_doctor_names_sequence_parallel_without_deepspeed():
    """``xtuner train`` refuses sequence parallel without ``--deepspeed`` before loading; the
    doctor, told the run's ``--deepspeed`` (or its absence), says the same."""
    from xtuner_rope.doctor.verdict import launch_problems

    (problem,) = launch_problems(4, None)
    assert (
        problem.startswith("sequence_parallel_size: sequence_parallel_size = 4 without DeepSpeed")
        and "zero2_fp32_cpu.json" in problem
    )
    assert launch_problems(4, "configs/deepspeed/zero2_fp32_cpu.json") == []
    assert launch_problems(1, None) == [] and launch_problems(None, None) == []
