"""Length-dependent RoPE through the real ``xtuner train`` of stock configs (issue 31).

Stock ``llama2_7b_chat_qlora_alpaca_e3`` on a tiny dynamic-NTK Llama (factor 4,
``max_position_embeddings`` 64) and ``phi3_mini_128k_instruct_full_alpaca_e3`` on a tiny
LongRoPE Phi-3 (``original_max_position_embeddings`` 64), localized as a user does, with the
README's one edit: packed rows of 512 tokens mix documents below and above the threshold.
Iteration 1 is captured inside the run and each document compared with itself alone through
the unpatched model; ``xtuner-rope doctor`` exits 0 and counts the documents past the
threshold; ``xtuner-rope check`` passes, and fails (exit 1) with ``per_document_rope=False``.
"""

import json

import pytest
import stock_configs as sc
import torch

from xtuner_rope.capture.text import CAPTURE_FILE
from xtuner_rope.cli import main
from xtuner_rope.demo.tiny import save_tiny

pytestmark = pytest.mark.slow

LONGROPE = dict(
    type="longrope",
    short_factor=[1.0 + 0.05 * i for i in range(8)],  # head_dim 16: 8 factors
    long_factor=[1.5 + 0.4 * i for i in range(8)],
)
RUNS = {
    "llama2_7b_chat_qlora_alpaca_e3": (
        "llama",
        dict(max_position_embeddings=64, rope_scaling=dict(rope_type="dynamic", factor=4.0)),
    ),
    "phi3_mini_128k_instruct_full_alpaca_e3": (
        "phi3",
        dict(
            max_position_embeddings=1024, original_max_position_embeddings=64, rope_scaling=LONGROPE
        ),
    ),
}
THRESHOLD = 64


def _config(name, tmp_path):
    family, overrides = RUNS[name]
    model = save_tiny(tmp_path / f"tiny-{family}", family, sc.SAMPLE_DATA, **overrides)
    stock = sc.copy_stock(name, tmp_path)
    stock.write_text(stock.read_text().replace("max_length = 128 * 1024", "max_length = 2048"))
    data = sc.write_alpaca_data(tmp_path / "alpaca", n=120)
    text = sc.localize(stock, data, lora_only=family == "llama", model=model)
    # XTuner's cut rows (the opt-out) mix short and long documents in iteration 1's row; the
    # default whole-dialogue packs (best-fit decreasing) put this seed's short ones together.
    # Per-document frequencies do not depend on how the rows were formed.
    config = tmp_path / f"{name}.py"
    config.write_text(sc.with_capture(sc.enable_plugin(text)) + '\noffline_packing = "cut"\n')
    return config


@pytest.mark.parametrize("name", list(RUNS))
def test_stock_config_trains_each_document_with_its_own_frequencies(name, tmp_path, capsys):
    config = _config(name, tmp_path)
    run = ("train_cfg.max_epochs=None", "train_cfg.max_iters=1", "randomness.seed=0")
    proc = sc.xtuner_train(config, tmp_path / "run", *run)
    out = proc.stdout + proc.stderr
    assert (tmp_path / "run" / CAPTURE_FILE).is_file(), out[-3000:]
    result = sc.assert_isolated_in_run(config, tmp_path / "run")
    lengths = [d["tokens"] for d in result["per_document"]]
    assert min(lengths) <= THRESHOLD < max(lengths), lengths  # the row mixes both kinds
    assert result["max_abs_diff"] <= 1e-4

    assert main(["doctor", str(config), "--out", str(tmp_path / "doctor")]) == 0
    report = json.loads((tmp_path / "doctor" / "report.json").read_text())
    rope = report["rope"]
    assert rope["threshold"] == THRESHOLD and rope["per_document"] is True
    assert 0 < rope["documents_past_threshold"] < rope["documents"], rope
    assert "get their own frequencies" in capsys.readouterr().out
    past = sum(n > THRESHOLD for n in lengths)
    with capsys.disabled():
        print(
            f"\n{name}: {len(lengths)} documents of iteration 1 ({past} past {THRESHOLD} "
            f"tokens), max |trained - alone| {result['max_abs_diff']:.3g}; doctor: "
            f"{rope['documents_past_threshold']} of {rope['documents']} documents past the "
            "threshold"
        )

    if name.startswith("llama"):  # the check's verdict, with and without the fix
        # The run's seed: XTuner's shuffle before packing draws from it, so both checks read
        # the run's first row (with its documents past the threshold), not a random one.
        check = [
            "check",
            str(config),
            "--max-documents",
            "16",
            "--cfg-options",
            "randomness.seed=0",
        ]
        assert main([*check, "--out", str(tmp_path / "check")]) == 0
        off = ["per_document_rope=False", "--out", str(tmp_path / "off")]
        assert main([*check, *off]) == 1
        report = json.loads((tmp_path / "off" / "report.json").read_text())
        worst = max(d["max_abs_diff"] for d in report["batches"][0]["logits"])
        assert worst > 1e-4, report["batches"][0]["logits"]
        with capsys.disabled():
            print(f"check with per_document_rope=False: max |packed - alone| {worst:.3g}")
    torch.set_grad_enabled(True)
