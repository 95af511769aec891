"""Catalogue of bad sequence-parallel settings and batches: refused before any step, named.

Each case calls what a run calls: the start-up's findings (``config.startup``,
``config.sequence_parallel``), the re-check of ``--cfg-options`` before the first step
(``config.overrides``), ``PackedBatchCheckHook``'s row check (``batch.sequence_parallel``),
and XTuner's own ``init_sequence_parallel`` (run by its ``DeepSpeedStrategy`` before the model
is built). The real 2-process runs are ``tests/integration/test_sequence_parallel_train.py``
and ``tests/batch/test_sequence_parallel_checks.py``.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from mmengine.config import Config
from stock_configs import ensure_tiny_model

from xtuner_rope.batch.sequence_parallel import check_sequence_parallel_rows
from xtuner_rope.compat.devices import cpu_only
from xtuner_rope.config.as_xtuner_train import start_file
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.overrides import cfg_options_argument, recheck_config
from xtuner_rope.config.sequence_parallel import sequence_parallel_heads_findings
from xtuner_rope.config.startup import prepare_config, state_kept

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "configs" / "tiny_internlm2_short_dialogues.py"  # 4 heads, rope_collate_fn


def _sp(sp, model_type="SupervisedFinetune", llm=None) -> Config:
    model = dict(type=model_type) if llm is None else dict(type=model_type, llm=llm)
    return Config(dict(sequence_parallel_size=sp, model=model))


# (call, error, regex): what the run refuses, before any step.
BAD = {
    "rows not divisible (XTuner's own SP split)": (
        lambda: check_sequence_parallel_rows((2, 13), 2, pads_itself=False),
        ValueError,
        r"sequence_parallel_size = 2: batch rows 0\.\.1 are 13 tokens long, not a multiple of 2 "
        r"\(13 % 2 = 1\).*rope_collate_fn\(\.\.\., pad_to_multiple_of=2\)",
    ),
    "SP larger than the row": (
        lambda: check_sequence_parallel_rows((1, 3), 4, pads_itself=False),
        ValueError,
        r"rows 0\.\.0 are 3 tokens long \(shorter than the 4 shards\)",
    ),
    "heads not divisible (CPU: XTuner's inner SP cannot run)": (
        lambda: _raise(
            sequence_parallel_heads_findings(
                _sp(3, llm=dict(pretrained_model_name_or_path=str(ensure_tiny_model())))
            )
        ),
        ConfigConflict,
        r"(?s)sequence_parallel_size: 3 does not divide the 4 attention heads.*set "
        r"sequence_parallel_size to a divisor of 4 \(1, 2, 4\)",
    ),
    "SP not a positive int": (
        lambda: prepare_config(_sp(0)),
        ConfigConflict,
        r"sequence_parallel_size: 0 is not a positive int",
    ),
    "SP outside SFT": (
        lambda: prepare_config(_sp(2, "RewardModel")),
        ConfigConflict,
        r"(?s)sequence_parallel_size: 2 with model type RewardModel.*set sequence_parallel_size = 1",
    ),
}


def _raise(findings) -> None:
    from xtuner_rope.config.findings import conflict_message

    if findings:
        raise ConfigConflict(conflict_message(findings))


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_sequence_parallel_input_is_refused_with_the_edit(case):
    call, error, match = BAD[case]
    if case.startswith("heads") and not cpu_only():
        pytest.skip("GPUs serve heads not divisible by the size (XTuner's inner SP)")
    with state_kept(), pytest.raises(error, match=match):
        call()


def test_rows_not_divisible_are_padded_by_the_plugin():
    """The plugin's SP loss adds a padding segment itself (equal to SP = 1:
    tests/models/test_sequence_parallel.py): nothing to refuse."""
    assert check_sequence_parallel_rows((2, 13), 2, pads_itself=True) is None
    assert check_sequence_parallel_rows((1, 3), 4, pads_itself=True) is None


@pytest.mark.parametrize(
    "overrides, setting, problem",
    [
        (  # a size the heads cannot take, set on the command line
            {"sequence_parallel_size": 3},
            "sequence_parallel_size",
            "3 does not divide the 4 attention heads",
        ),
        (  # SP switched on after the start-up: the finding is the collate function's
            {
                "sequence_parallel_size": 2,
                "train_dataloader.collate_fn": dict(type="default_collate_fn"),
            },
            "train_dataloader.collate_fn",
            "default_collate_fn asserts that packed rows divide by sequence_parallel_size=2",
        ),
    ],
    ids=["heads", "collate"],
)
def test_sequence_parallel_changed_on_the_command_line_names_the_override(
    overrides, setting, problem
):
    ensure_tiny_model()
    with state_kept():
        cfg = start_file(str(TINY_RECIPE), overrides)
        conflicts = [c for c in recheck_config(cfg, overrides=overrides) if c.setting == setting]
    (conflict,) = conflicts
    assert conflict.problem.startswith("set after the start-up ran (--cfg-options): " + problem)
    given = " ".join(f"{k}={v}" for k, v in overrides.items())
    assert conflict.problem.endswith(f"(--cfg-options given: {given})"), conflict.problem


def test_the_run_reads_its_overrides_from_the_xtuner_train_command_line():
    argv = [
        "train.py",
        "cfg.py",
        "--cfg-options",
        "sequence_parallel_size=3",
        "a.b=1",
        "--seed",
        "0",
    ]
    assert cfg_options_argument(argv) == ["sequence_parallel_size=3", "a.b=1"]
    assert cfg_options_argument(["train.py", "cfg.py"]) == []


@pytest.mark.slow
def test_sequence_parallel_larger_than_the_world_is_refused_by_xtuner():
    """XTuner's ``DeepSpeedStrategy`` runs ``init_sequence_parallel`` before the model is
    built; its message names the setting (one gloo process, SP = 2)."""
    code = (
        "import torch.distributed as d\n"
        "d.init_process_group('gloo', init_method='tcp://127.0.0.1:29631', rank=0, world_size=1)\n"
        "from xtuner.parallel.sequence import init_sequence_parallel\n"
        "init_sequence_parallel(2)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "world_size (1) is not divisible by sequence_parallel_size 2" in run.stderr
