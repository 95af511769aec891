"""The zoo sweep (``python -m tools.zoo``): the real sweep on a fixed sample.

The sample, one row per way a stock config ends here, each judged with the doctor's reason:
the stock Cohere config (sequence parallel over 32 ranks: refused by the start-up before its
checkpoint is looked up) and the stock Qwen1.5 pretrain config (its warm-up rounds to 0
iterations on the small data: refused by name once the dataset's length is known, instead of
MMEngine's "end should be larger than begin"), and, for every covered family that no other CI
test trains from a stock config, its cheapest stock config that trains isolated (Mistral full
varlen in bf16, Mixtral QLoRA, Qwen1.5-MoE full, Gemma QLoRA; LoRA without 4-bit). InternLM2,
Llama and Phi-3 are measured isolated inside real runs of their stock configs by the tests of
``TRAINED_ELSEWHERE`` (InternLM2's full finetune; Llama 2 QLoRA with dynamic NTK; Phi-3's 4k
QLoRA, and its 128k full in ``test_length_dependent_rope.py``; the sweep's InternLM2 QLoRA
config itself trains in ``test_stock_configs.py::test_lora_with_one_edit``), so their rows
(InternLM2 QLoRA, Llama 3 QLoRA, Phi-3 128k QLoRA) left the sample on 2026-11-27 (about 50 s
of CI). One sweep session, ``--jobs 2``.
DeepSeek-V2's refusal is tested from the config alone (``test_zoo_refusals.py``); the other rows
are in ``docs/zoo``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import stock_configs as sc

from tools import zoo
from xtuner_rope.models.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]
SAMPLE = {
    "cohere_100b_128k_sp32": zoo.REFUSED,
    "qwen1_5_0_5b_full_custom_pretrain_e1": zoo.REFUSED_AT_DATA,
    "mistral_7b_full_finetune_custom_dataset_e1": zoo.TRAINED,
    "mixtral_8x7b_qlora_oasst1_e3": zoo.TRAINED,
    "qwen1_5_moe_a2_7_b_chat_full_alpaca_e3": zoo.TRAINED,
    "gemma_7b_it_qlora_alpaca_e3": zoo.TRAINED,
}
# The families the plugin serves, each with at least one row above or a CI test that trains
# one of its stock configs isolated through the real `xtuner train` (a new family needs one).
COVERED = set(FAMILIES) | {"internlm2"}
TRAINED_ELSEWHERE = {
    "internlm2": "tests/integration/test_stock_configs.py::test_full_finetune_with_one_edit",
    "llama": "tests/integration/test_length_dependent_rope.py::"
    "test_stock_config_trains_each_document_with_its_own_frequencies",
    "phi3": "tests/integration/test_stock_families.py::"
    "test_phi3_stock_qlora_config_trains_isolated_with_one_edit",
}


@pytest.mark.slow
def test_sweep_of_the_fixed_sample(tmp_path):
    sc.ensure_tiny_model()
    results = tmp_path / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.zoo",
            *SAMPLE,
            "--jobs",
            "2",
            "--out",
            str(tmp_path / "zoo"),
            "--results",
            str(results),
            "--markdown",
            str(tmp_path / "zoo.md"),
            "--models",
            str(REPO / "models"),
        ],
        cwd=REPO,
        env=sc.venv_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    rows = json.loads(results.read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, outcome in SAMPLE.items():
        assert rows[name]["outcome"] == outcome, rows[name]
        assert rows[name]["predicted"] is True, rows[name]  # the doctor's reason included
    assert {rows[name]["family"] for name in SAMPLE} | set(TRAINED_ELSEWHERE) == COVERED
    for name, outcome in SAMPLE.items():
        if outcome == zoo.TRAINED:  # packed rows, each document equal to itself alone
            row = rows[name]
            assert row["most_in_a_row"] > 1 and row["relative"] <= row["tolerance"], row
    trained = rows["gemma_7b_it_qlora_alpaca_e3"]
    assert trained["most_in_a_row"] > 1 and trained["relative"] <= zoo.ISOLATION_TOLERANCE
    assert trained["mode"] == {"tuning": "qlora", "packing": "packed", "kind": "sft"}
    assert "sequence_parallel_size: 32" in rows["cohere_100b_128k_sp32"]["message"]
    warmup = rows["qwen1_5_0_5b_full_custom_pretrain_e1"]
    assert warmup["refused"] == ["param_scheduler[0]"] and "warmup_ratio" in " ".join(
        warmup["doctor"]["reasons"]
    )
    assert "1/6" in proc.stdout and "6/6" in proc.stdout  # the progress bar
    table = (tmp_path / "zoo.md").read_text()
    assert "| gemma_7b_it_qlora_alpaca_e3 | gemma | sft/qlora/packed | trained isolated |" in table
    assert (
        "Counts: trained isolated 4, not exercised 0, refused before loading 1, refused before "
        "training 1, needs what this machine lacks 0, not a training config 0, crashed 0, "
        "leaked 0, sweep error 0, doctor right 6, doctor wrong 0" in table
    )
    # Resumable: nothing is left to run; nothing failed.
    for only in ("missing", "failed"):
        assert zoo.select(list(SAMPLE), rows, only) == []


def test_families_trained_elsewhere_name_real_tests_that_measure_isolation():
    for family, test in TRAINED_ELSEWHERE.items():
        path, name = test.split("::")
        text = (REPO / path).read_text(encoding="utf-8")
        body = text.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
        assert "assert_isolated_in_run(" in body, (family, test)
        assert family in FAMILIES or family == "internlm2", family


def _row(outcome, exit_code, reasons=(), **kw):
    return {"outcome": outcome, "doctor": {"exit_code": exit_code, "reasons": list(reasons)}, **kw}


def test_select_resumes_and_reruns_failed():
    rows = {
        "a": _row(zoo.TRAINED, 0),
        "b": _row(zoo.CRASHED, 1, ["x: y"], message="ValueError: boom"),
        "c": _row(zoo.REFUSED, 0, refused=["sequence_parallel_size"]),
        "d": _row(zoo.LACKS, 1, ["OSError: offline"]),
        "f": {"outcome": zoo.REFUSED, "doctor": {"exit_code": 1}},
    }  # no reasons recorded
    assert zoo.select(["a", "b", "c", "d", "e", "f"], rows, "missing") == ["e"]
    assert zoo.select(["a", "b", "c", "d", "e", "f"], rows, "failed") == ["b", "c", "f"]
    assert zoo.select(["g"], {"g": _row(zoo.SWEEP_ERROR, 1, ["x: y"])}, "failed") == ["g"]
    with pytest.raises(ValueError, match=r"only='x': expected one of missing, failed, all"):
        zoo.select([], rows, "x")


def test_the_doctor_is_right_only_for_the_same_reason():
    """Exit 1 counts only when the doctor named what stopped the run."""
    refused = dict(refused=["sequence_parallel_size"], message="sequence_parallel_size: 32: no")
    assert (
        zoo.doctor_agrees(_row(zoo.REFUSED, 1, ["sequence_parallel_size: 32: no"], **refused))
        is True
    )
    assert (
        zoo.doctor_agrees(_row(zoo.REFUSED, 1, ["OSError: couldn't connect"], **refused)) is False
    )  # right exit code, wrong reason
    assert zoo.doctor_agrees(_row(zoo.REFUSED, 0, **refused)) is False
    warmup = dict(refused=["param_scheduler[0]"], message="param_scheduler[0]: LinearLR ...")
    assert (
        zoo.doctor_agrees(
            _row(zoo.REFUSED_AT_DATA, 1, ["param_scheduler[0]: LinearLR, begin=0 ..."], **warmup)
        )
        is True
    )
    crash = dict(message="ValueError: end should be larger than begin, but got begin=0, end=0")
    assert (
        zoo.doctor_agrees(
            _row(
                zoo.CRASHED,
                1,
                [
                    "param_scheduler[0]: ... MMEngine refuses "
                    "it (ValueError: end should be larger than "
                    "begin, but got begin=0, end=0)"
                ],
                **crash,
            )
        )
        is True
    )
    assert zoo.doctor_agrees(_row(zoo.CRASHED, 1, ["OSError: offline"], **crash)) is False
    assert zoo.doctor_agrees(_row(zoo.TRAINED, 0)) is True
    assert zoo.doctor_agrees(_row(zoo.TRAINED, 1, ["x: y"])) is False
    assert zoo.doctor_agrees(_row(zoo.LACKS, 1, ["OSError: offline"])) is None
    counts = zoo.counts(
        {"a": _row(zoo.TRAINED, 0), "b": _row(zoo.REFUSED, 1, ["OSError: x"], **refused)}
    )
    assert counts["doctor right"] == 1 and counts["doctor wrong"] == 1


def test_refusals_and_doctor_reasons_are_read_from_the_logs(tmp_path):
    from xtuner_rope.config.findings import Finding, conflict_message

    out = "noise\n" + conflict_message(
        [Finding("a.b", "bad", "edit it"), Finding("param_scheduler[0]", "LinearLR: 0", "longer")]
    )
    assert zoo.refused_settings(out) == ["a.b", "param_scheduler[0]"]
    assert zoo.doctor_reasons(tmp_path / "none.json", out) == [
        "a.b: bad",
        "param_scheduler[0]: LinearLR: 0",
    ]
    assert zoo.doctor_reasons(tmp_path / "none.json", "Traceback\nOSError: offline\n") == [
        "OSError: offline"
    ]
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps(
            {
                "findings": {"conflicts": [{"setting": "s", "problem": "p", "edit": "e"}]},
                "problems": ["q: r"],
            }
        )
    )
    assert zoo.doctor_reasons(report, "") == ["s: p", "q: r"]


def test_patterns_keep_their_order_and_family():
    names = zoo.list_configs(["zephyr_7b_beta_qlora_alpaca_e3", "internlm2_chat_1_8b_*"])
    assert names[0] == "zephyr_7b_beta_qlora_alpaca_e3" and len(names) > 5
    assert zoo.family_of("zephyr_7b_beta_qlora_alpaca_e3") == "mistral"
    assert zoo.family_of("internlm2_5_chat_7b_qlora_alpaca_e3") == "internlm2"
    assert zoo.family_of("qwen1_5_0_5b_chat_qlora_alpaca_e3") == "qwen2"


def test_localize_makes_the_cpu_edits(tmp_path):
    from xtuner.configs import cfgs_name_path  # the file `xtuner copy-cfg` copies

    stock = Path(cfgs_name_path["llama2_7b_chat_qlora_alpaca_e3"]).read_text()
    text = zoo.enable_plugin(zoo.localize(stock, tmp_path / "m", tmp_path / "d"))
    assert (
        f'pretrained_model_name_or_path = "{tmp_path / "m"}"\nfrom xtuner_rope import '
        "enable_xtuner_rope\nmodel_resource = dict(fn=enable_xtuner_rope)\n" in text
    )
    assert f'alpaca_en_path = "{tmp_path / "d"}"' in text
    assert "quantization_config" not in text and "AmpOptimWrapper" not in text
    assert "type=OptimWrapper," in text and "max_length = 512" in text
    compile(zoo.with_capture(text), "config", "exec")
    gemma = Path(cfgs_name_path["gemma_2b_qlora_alpaca_e3"]).read_text()  # path in ( ... )
    compile(zoo.enable_plugin(zoo.localize(gemma, None, tmp_path)), "gemma", "exec")
    compile(zoo.enable_plugin(zoo.localize(gemma, tmp_path / "m", tmp_path)), "gemma", "exec")
    with pytest.raises(ValueError, match=r"no 'pretrained_model_name_or_path = \.\.\.' line"):
        zoo.enable_plugin("x = 1\n")


def test_isolation_tolerance_follows_the_runs_dtype():
    """A ``torch_dtype=torch.bfloat16`` config (stock Mistral full) trains in bf16 on CPU too:
    its logits are judged with ``check``'s bf16 tolerance, an fp32 run with 1e-5."""
    assert zoo.isolation_tolerance("float32") == zoo.ISOLATION_TOLERANCE == 1e-5
    assert zoo.isolation_tolerance("bfloat16") == 8 * 2**-8  # 0.031; leaks move 0.2 to 2
    with pytest.raises(KeyError):
        zoo.isolation_tolerance("int8")
