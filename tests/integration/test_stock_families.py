"""A stock config of a family added by issue 24, trained by the real ``xtuner train`` with the
README's one edit, isolation measured inside the run (the refusals before loading are tested in
test_models_families.py on the start-up and the doctor, which ``xtuner train`` runs first).

``phi3_mini_4k_instruct_qlora_alpaca_e3`` as a user runs it on a CPU: localized (tiny Phi-3
checkpoint built by transformers' own classes, local alpaca data), LoRA without 4-bit.
"""

import pytest
import stock_configs as sc

from xtuner_rope.demo.runlog import check_run
from xtuner_rope.demo.tiny import save_tiny

PHI3 = "phi3_mini_4k_instruct_qlora_alpaca_e3"
SHORT_RUN = (
    "train_cfg.max_epochs=None",
    "train_cfg.max_iters=8",
    "default_hooks.logger.interval=2",
    "randomness.seed=0",
)

pytestmark = pytest.mark.slow


def test_phi3_stock_qlora_config_trains_isolated_with_one_edit(tmp_path):
    model = save_tiny(tmp_path / "tiny-phi3", "phi3", sc.SAMPLE_DATA)
    stock = sc.copy_stock(PHI3, tmp_path)
    data = sc.write_alpaca_data(tmp_path / "alpaca", n=200)
    text = sc.localize(stock, data, lora_only=True, model=model)
    config = tmp_path / f"{PHI3}.py"
    config.write_text(sc.with_capture(sc.enable_plugin(text)))
    proc = sc.xtuner_train(config, tmp_path / "run", *SHORT_RUN)
    out = proc.stdout + proc.stderr
    run = check_run(tmp_path / "run", min_iters=8)
    assert "ValidatedRoPEHook: 2 Phi3 attention layers use the validated fp32 RoPE" in out
    assert run.losses[-1] < run.losses[0], run.losses
    result = sc.assert_isolated_in_run(config, tmp_path / "run")
    print(
        f"{PHI3}: loss {run.losses}, {result['documents']} documents, "
        f"max |trained - alone| {result['max_abs_diff']:.3g}"
    )
