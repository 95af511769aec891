"""``xtuner-rope check`` on the tiny recipes and on XTuner's stock config, CPU, fp32.

Each run builds the config's real model and first packed batch and compares every packed
document with the same document alone (logits, loss, gradients) and patched with unpatched
generation; a stock config without the plugin's edit and a recipe whose hooks are removed
must fail with the leak measured.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import stock_configs as sc
import torch
from mmengine.config import Config

from xtuner_rope.capture.measure import documents
from xtuner_rope.check.report import TOLERANCES
from xtuner_rope.check.runner import train_dtype
from xtuner_rope.cli import main

REPO = Path(__file__).resolve().parents[2]
INTERNLM2 = REPO / "configs" / "tiny_internlm2_short_dialogues.py"
QWEN2 = REPO / "configs" / "tiny_qwen2_short_dialogues.py"
FULL = "internlm2_chat_1_8b_full_alpaca_e3"

pytestmark = pytest.mark.slow


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _isolated(report: dict) -> None:
    """Every figure within the fp32 tolerance, on packed rows of several documents."""
    tol = TOLERANCES["float32"]
    assert report["model"]["dtype"] == "float32" and report["plugin"]["patched"]
    batch = report["batches"][0]
    assert batch["documents"] > batch["rows"], batch  # really packed
    assert batch["labels"]["packed"] == batch["labels"]["documents"]
    assert all(
        d["max_abs_diff"] <= tol["logits"] * max(1, d["max_abs_logit"]) for d in batch["logits"]
    ), batch["logits"]
    loss = batch["loss"]
    assert abs(loss["packed"] - loss["documents"]) <= tol["loss"] * max(1, loss["documents"])
    assert report["grads"]["max_abs_diff"] <= tol["grads"] * report["grads"]["max_abs_grad"]
    assert report["grads"]["max_abs_grad"] > 0
    gen = report["generation"]
    assert len(gen["patched"]) == 8 and gen["patched"] == gen["unpatched"]
    assert report["exit_code"] == 0 and report["problems"] == []
    chunked = report["chunked_loss"]  # the chunked loss against the model's own
    assert chunked["compared"] and all(v <= 1e-6 for v in chunked["relative"].values()), chunked


def test_tiny_internlm2_recipe_passes_through_console_script(tmp_path):
    script = Path(sys.executable).parent / "xtuner-rope"
    proc = subprocess.run(
        [str(script), "check", str(INTERNLM2), "--out", str(tmp_path)],
        cwd=REPO,
        env=sc.venv_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: each packed document gets the logits, loss and gradients" in proc.stdout
    assert "packed backend sdpa" in proc.stdout
    report = _report(tmp_path)
    _isolated(report)
    assert report["model"]["class"] == "InternLM2ForCausalLM"
    assert report["model"]["attn_implementation"] == "sdpa"
    assert report["plugin"]["hooks"] == ["ValidatedRoPEHook", "PackedBatchCheckHook"]
    assert report["batches"][0]["boundaries"] == "cumulative_len"
    assert "  chunked  loss " in proc.stdout


def test_tiny_qwen2_recipe_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["check", str(QWEN2), "--out", str(tmp_path), "--batches", "2"]) == 0
    assert "PASS" in capsys.readouterr().out
    report = _report(tmp_path)
    _isolated(report)
    assert report["model"]["class"] == "Qwen2ForCausalLM"
    assert report["chunked_loss"]["head_parameters"] == ["weight"]  # tied to the embeddings
    assert len(report["batches"]) == 2


def test_hook_free_run_fails_with_the_leak(tmp_path, monkeypatch, capsys):
    """The recipe with its hooks removed: nothing patches the model, documents leak."""
    monkeypatch.chdir(REPO)
    code = main(
        ["check", str(INTERNLM2), "--out", str(tmp_path), "--cfg-options", "custom_hooks=[]"]
    )
    out = capsys.readouterr().out
    assert code == 1
    report = _report(tmp_path)
    assert not report["plugin"]["patched"] and report["plugin"]["hooks"] == []
    assert report["chunked_loss"] is None  # nothing patched, nothing chunked
    assert report["figures"]["logits"]["max_abs_diff"] > 0.05  # a leak, not rounding
    assert report["batches"][0]["unconsumed_keys"][:2] == ["cumulative_len", "max_seqlen"]
    assert "documents attend to each other" in out and "FAIL: logits" in out
    assert "model_resource = dict(fn=enable_xtuner_rope)" in out


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stock")
    sc.ensure_tiny_model()
    return {
        "root": root,
        "alpaca": sc.write_alpaca_data(root / "alpaca"),
        FULL: sc.copy_stock(FULL, root),
    }


def test_stock_config_without_the_edit_shows_xtuner_packing_leak(stock, tmp_path, capsys):
    config = tmp_path / "stock.py"
    config.write_text(sc.localize(stock[FULL], stock["alpaca"]))
    assert main(["check", str(config), "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    report = _report(tmp_path / "out")
    batch = report["batches"][0]
    assert batch["boundaries"].startswith("XTuner's packs rebuilt with use_varlen_attn=True")
    assert batch["documents"] > 1 and report["plugin"]["model_resource"] is None
    assert report["figures"]["logits"]["max_abs_diff"] > 0.05
    assert report["figures"]["grads"]["relative"] > 1e-3
    assert "documents attend to each other" in out
    assert "xtuner-rope's patch is not applied" in out


def test_conflict_is_printed_with_its_edit(stock, tmp_path, capsys):
    """The shipped AmpOptimWrapper on this CPU machine: refused by the start-up, exit 1."""
    if torch.cuda.is_available():
        pytest.skip("AmpOptimWrapper is fine on a GPU")
    config = tmp_path / "amp.py"
    config.write_text(sc.enable_plugin(sc.localize(stock[FULL], stock["alpaca"], cpu=False)))
    assert main(["check", str(config), "--out", str(tmp_path / "out")]) == 1
    assert "optim_wrapper.type: AmpOptimWrapper needs a GPU" in capsys.readouterr().out
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.parametrize(
    "cfg, device, expected",
    [
        (dict(optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16")), "cpu", torch.float32),
        (
            dict(optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16")),
            "cuda",
            torch.bfloat16,
        ),
        (dict(optim_wrapper=dict(type="AmpOptimWrapper")), "cuda", torch.float16),
        (
            dict(strategy=dict(config=str(REPO / "configs/deepspeed/zero2_bf16.json"))),
            "cuda",
            torch.bfloat16,
        ),
        (dict(strategy=dict(config=dict(fp16=dict(enabled=True)))), "cuda", torch.float16),
        (dict(model=dict(llm=dict(torch_dtype=torch.bfloat16))), "cuda", torch.bfloat16),
        (dict(), "cuda", torch.float32),
    ],
)
def test_train_dtype(cfg, device, expected):
    assert train_dtype(Config(cfg), torch.device(device)) == expected


def test_documents_cut_after_max_documents():
    """Rows are cut at the end of the last kept document; padding segments are no documents."""
    ids = torch.arange(20).reshape(2, 10)
    labels = torch.full((2, 10), -100)
    labels[:, 1:] = 1
    labels[0, 8:] = -100  # row 0: documents 0-3, 3-6, padding 6-10 (no label)
    labels[0, 6:8] = -100
    data = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": ids * 0,
        "cumulative_len": [torch.tensor([0, 3, 6, 10]), torch.tensor([0, 4, 10])],
        "max_seqlen": 6,
    }
    docs, source = documents(data, None, max_documents=2)
    assert source == "cumulative_len"
    assert docs == [(0, 0, 3), (0, 3, 6), (1, 0, 4), (1, 4, 6)]
    assert data["input_ids"].shape == (2, 6) and data["max_seqlen"] == 4
    assert [c.tolist() for c in data["cumulative_len"]] == [[0, 3, 6], [0, 4, 6]]


def test_documents_refuses_a_batch_without_labels():
    data = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.full((1, 4), -100)}
    with pytest.raises(
        ValueError,
        match=r"first batch has no supervised label: nothing to "
        r"compare.*xtuner-rope doctor",
    ):
        documents(data, None, max_documents=8)


def test_unrecorded_packs_that_cannot_be_found_are_refused(stock, tmp_path):
    """Boundaries of stock packs are looked up in the same packs rebuilt with their boundaries;
    a pack that is not there is refused with the setting to change, never guessed."""
    from xtuner_rope.capture.text import compare_capture
    from xtuner_rope.check.runner import _recorded_packs

    config = tmp_path / "stock.py"
    config.write_text(sc.localize(stock[FULL], stock["alpaca"]))
    cfg = Config.fromfile(str(config))
    with pytest.raises(
        ValueError,
        match=r"pack 0 differs when the dataset records its "
        r"boundaries.*use_varlen_attn=True",
    ):
        _recorded_packs(cfg.train_dataloader.dataset, [{"input_ids": [1, 2, 3]}], 1)
    ids = torch.tensor([[1, 5, 6, 7]])
    torch.save(
        {
            "data": {"input_ids": ids, "labels": ids, "attention_mask": ids > 0},
            "logits": torch.zeros(1, 4, 8),
            "loss": 0.0,
        },
        tmp_path / "capture.pt",
    )
    with pytest.raises(
        ValueError,
        match=r"captured row 0 matches no pack.*"
        r"shuffle_before_pack=False",
    ):
        compare_capture(config, tmp_path / "capture.pt")


QLORA = "internlm2_chat_1_8b_qlora_alpaca_e3"


@pytest.fixture(scope="module")
def stock_lora(stock) -> Path:
    """XTuner's stock QLoRA config without 4-bit (CPU), ``lora_dropout=0.1`` as shipped."""
    copied = sc.copy_stock(QLORA, stock["root"])
    assert "lora_dropout=0.1" in copied.read_text()
    return copied


def test_stock_lora_with_dropout_passes_and_reports_the_backend_it_ran(
    stock, stock_lora, tmp_path, capsys
):
    """Dropout 0.1 draws different masks for the packed and the per-document passes: the check
    switches it off in both (and says so), so isolated documents pass; the backend it reports
    is the one the patched attention chose in the packed pass, in the layers the model has."""
    config = tmp_path / "lora.py"
    config.write_text(sc.enable_plugin(sc.localize(stock_lora, stock["alpaca"], lora_only=True)))
    assert main(["check", str(config), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    report = _report(tmp_path / "out")
    assert report["randomness"]["dropout_p"] == [0.1] and report["randomness"]["dropout_modules"]
    assert "dropout modules (p 0.1)" in out and "off in both passes" in out
    model = report["model"]
    assert model["attention_layers"] == ["InternLM2Attention"]  # eager layers (stock llm dict)
    assert model["attn_implementation"] == "eager"  # InternLM2's config.attn_implementation
    assert model["packed_backend"] == "eager"
    assert "packed backend eager (layers InternLM2Attention)" in out
    assert report["figures"]["grads"]["relative"] <= report["figures"]["grads"]["tolerance"]
    assert report["exit_code"] == 0, report["problems"]
    chunked = report["chunked_loss"]  # LoRA on the head: its adapters' gradients compared
    assert any("lora_A" in n for n in chunked["head_parameters"]), chunked
    assert all(v <= 1e-6 for v in chunked["relative"].values()), chunked


def test_stock_lora_without_the_edit_still_fails(stock, stock_lora, tmp_path, capsys):
    """Dropout off does not hide a real leak: without the plugin the same config fails."""
    config = tmp_path / "lora_plain.py"
    config.write_text(sc.localize(stock_lora, stock["alpaca"], lora_only=True))
    assert main(["check", str(config), "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    report = _report(tmp_path / "out")
    assert report["figures"]["logits"]["max_abs_diff"] > 0.05
    assert "off in both passes" in out and "documents attend to each other" in out
