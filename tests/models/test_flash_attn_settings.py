"""Settings that need flash-attn where it cannot run become SDPA at start-up, logged.

XTuner's stock Mistral configs ask for ``attn_implementation="flash_attention_2"``: without
flash-attn, transformers refuses to build the model. xtuner-rope's packed attention isolates
documents on every backend, so the start-up switches to SDPA; the doctor reports it, and an
override that asks for flash-attn again is reported against the config that really trains.
"""

import pytest
import stock_configs as sc
from transformers.utils import is_flash_attn_2_available

from xtuner_rope.config import startup
from xtuner_rope.demo.runlog import check_run
from xtuner_rope.demo.tiny import save_tiny
from xtuner_rope.doctor.diagnose import start_like_xtuner_train

MISTRAL = "mistral_7b_full_finetune_custom_dataset_e1"
SWITCHED = (
    'xtuner-rope: model.llm.attn_implementation: "flash_attention_2" needs flash-attn, '
    "which is not usable here (not installed, or no CUDA): the model would fail to "
    'build or to run; set to "sdpa": xtuner-rope\'s packed attention isolates '
    "documents on every backend."
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        is_flash_attn_2_available(), reason="flash-attn is usable here: nothing to switch"
    ),
]


@pytest.fixture(scope="module")
def mistral_config(tmp_path_factory):
    """XTuner's stock Mistral config on a tiny Mistral, ``flash_attention_2`` left in."""
    root = tmp_path_factory.mktemp("mistral")
    model = save_tiny(root / "tiny-mistral", "mistral")
    stock = sc.copy_stock(MISTRAL, root)
    text = sc.localize(stock, sc.write_conversation_data(root / "conv.json"), model=model)
    assert 'attn_implementation="flash_attention_2"' in text
    path = root / f"{MISTRAL}.py"
    path.write_text(sc.enable_plugin(text))
    return path


def test_doctor_reports_the_switch_and_an_override_that_undoes_it(mistral_config, monkeypatch):
    monkeypatch.setitem(startup._STATE, "prepared", False)
    cfg, findings, _ = start_like_xtuner_train(str(mistral_config))
    switch = next(f for f in findings if f.setting == "model.llm.attn_implementation")
    assert f"{switch.setting}: {switch.problem}; {switch.edit}." in SWITCHED
    assert cfg.model.llm.attn_implementation == "sdpa"
    assert not any(f.fix is None for f in findings)
    _, findings, _ = start_like_xtuner_train(
        str(mistral_config), {"model.llm.attn_implementation": "flash_attention_2"}
    )
    undone = [f for f in findings if f.fix is None]
    assert [f.setting for f in undone] == ["model.llm.attn_implementation"]
    assert undone[0].problem.startswith('the start-up\'s fix (set to "sdpa"')
    assert not startup.is_prepared()  # the doctor looked; it started no run in this process


def test_stock_mistral_config_trains_on_cpu_without_flash_attn(mistral_config, tmp_path):
    work_dir = tmp_path / "run"
    proc = sc.xtuner_train(
        mistral_config,
        work_dir,
        "train_cfg.max_epochs=None",
        "train_cfg.max_iters=20",
        "default_hooks.logger.interval=5",
        "randomness.seed=0",
    )
    out = proc.stdout + proc.stderr
    assert SWITCHED in out
    assert "ValidatedRoPEHook: 2 Mistral attention layers" in out
    run = check_run(work_dir, min_iters=20)
    assert run.losses[-1] < run.losses[0] - 0.05, run.losses
    line = next(x for x in out.splitlines() if "PackedBatchCheckHook: first batch" in x)
    assert int(line.split("tokens, ")[1].split(" segments")[0]) > 1, line  # packed, isolated
