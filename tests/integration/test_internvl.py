"""XTuner's stock InternVL configs with the README's one edit, on tiny InternVL checkpoints.

Two real ``xtuner train`` runs (copied with ``xtuner copy-cfg``, the user's own-machine edits of
``internvl_configs.localize_internvl``, the edit after ``path = ...``, 8 drawn-image and 8 short
text-only dialogues, ``max_length`` 512, batch 4, 4 iterations), each with
``InternVLIsolationCaptureHook`` recording what reached the LLM at iteration 1:

- ``internvl_v2_internlm2_2b_lora_finetune`` (tiny InternLM2 with hub-style remote code, LoRA),
  padded rows as shipped (``default_collate_fn``);
- ``internvl_v2_phi3_4b_finetune`` (tiny Phi-3, full fine-tune), rows packed by
  ``internvl_collate_fn``, with the in-run negative control (the same packed rows through an
  unpatched copy of the LLM leak).

For both, a fresh process rebuilds the config's model unpatched, gives its LLM the step's
weights and runs each captured sample alone: within 1e-4 of the run's logits. The Phi-3 run
also has ``heldout = dict(data_files=..., image_folder=..., interval=2)``: its logged held-out
loss at iteration 4 equals each held-out sample alone through XTuner's ``InternVL_V1_5.forward``
with ``iter_4.pth``'s weights in a fresh process without the plugin
(``tests/support/internvl_heldout_reference.py``). Issue 57's opt-out pair: the Phi-3 run against a
twin with ``chunked_loss=False`` (docs/loss.md).
"""

import json
import subprocess
import sys
from pathlib import Path

import heldout as ho
import internvl_configs as ic
import pytest
import stock_configs as sc
import torch
from opt_out import EVERY_ITERATION, OPT_OUT

from xtuner_rope.capture.internvl import INTERNVL_CAPTURE_FILE
from xtuner_rope.demo.llava_data import write_llava_data
from xtuner_rope.demo.runlog import check_run

pytestmark = pytest.mark.slow
CHUNKED_LINE = "xtuner-rope: chunked loss: the training loss projects only the supervised tokens"
HELD_OUT_CHUNKED = "the held-out log-probs too; opt out: chunked_loss = False"  # docs/loss.md


@pytest.fixture(scope="session")
def internvl(tmp_path_factory) -> dict:
    return ic.internvl_assets(tmp_path_factory.mktemp("internvl"))


def _config(internvl: dict, name: str, model: str, path: Path, packed: bool = False) -> Path:
    text = ic.localize_internvl(internvl[name], internvl[model], internvl["data"])
    text = ic.with_internvl_capture(ic.enable_plugin_internvl(text))
    path.write_text(ic.with_internvl_collate(text) if packed else text)
    return path


def _fresh_compare(config: Path, work_dir: Path) -> dict:
    """``compare_internvl_capture`` in a fresh process (nothing of the run's patches)."""
    proc = subprocess.run(
        [sys.executable, "-m", "xtuner_rope.capture.internvl", str(config),
         str(work_dir / INTERNVL_CAPTURE_FILE)],
        capture_output=True, text=True, env=sc.venv_env(), cwd=sc.REPO, timeout=600,
    )  # fmt: skip
    line = [x for x in proc.stdout.splitlines() if x.startswith("INTERNVL_COMPARE=")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0].removeprefix("INTERNVL_COMPARE="))


def _assert_isolated(result: dict) -> None:
    for sample in result["per_sample"]:
        assert sample["max_abs_diff"] <= 1e-4, sample
    assert abs(result["loss"]["captured"] - result["loss"]["samples"]) <= 1e-4, result["loss"]


def _train(config: Path, work_dir: Path, *extra: str) -> str:
    proc = sc.xtuner_train(config, work_dir, "randomness.seed=0", *EVERY_ITERATION, *extra)
    out = proc.stdout + proc.stderr
    check_run(work_dir, min_iters=4)
    assert "set to path = " in out, out[-3000:]  # the edit after `path = ...` reached XTuner
    assert 'XTuner loads the LLM with attn_implementation="flash_attention_2"' in out
    assert "loaded in float32" in out, out[-3000:]
    assert "InternVLIsolationCaptureHook: saved" in out, out[-3000:]
    # The LLM computes the loss through the chunked loss (iteration 1 paused for the capture).
    assert (CHUNKED_LINE in out) == (OPT_OUT not in extra), out[-3000:]
    return out


def _images_in(saved: dict, internvl: dict, model: str) -> int:
    """Samples of the captured batch that hold an image (``<IMG_CONTEXT>`` ids)."""
    from transformers import AutoTokenizer

    context = AutoTokenizer.from_pretrained(internvl[model]).convert_tokens_to_ids("<IMG_CONTEXT>")
    return int((saved["input_ids"] == context).any(dim=1).sum())


def test_internlm2_lora_config_trains_padded_each_sample_as_alone(internvl, tmp_path):
    config = _config(internvl, ic.INTERNLM2_LORA, "internlm2", tmp_path / "internlm2_lora.py")
    out = _train(config, tmp_path / "run")
    assert "ValidatedRoPEHook: 2 InternLM2 attention layers" in out, out[-3000:]
    assert "(LoRA-adapted nn.Linear(" in out, out[-3000:]  # LoRA on InternLM2's head too
    assert "PackedBatchCheckHook: first batch 4 rows x" in out, out[-3000:]
    saved = torch.load(tmp_path / "run" / INTERNVL_CAPTURE_FILE, weights_only=False)
    assert any("lora_A" in k for k in saved["llm_state"]), "LoRA on the LLM"
    assert len(set(saved["attention_mask"].sum(dim=1).tolist())) > 1  # padded rows
    result = _fresh_compare(config, tmp_path / "run")
    _assert_isolated(result)
    assert result["samples"] == 4, result
    print(
        f"InternVL InternLM2 LoRA, padded: {result['samples']} samples "
        f"({_images_in(saved, internvl, 'internlm2')} with an image), max |trained - alone| "
        f"{result['max_abs_diff']:.3g} (fresh process)"
    )


def _with_heldout(config: Path, held: Path) -> Path:
    """The ``heldout`` shortcut after ``path = ...``: ``held``'s samples, every 2 iterations."""
    line = (
        f'heldout = dict(data_files="{held}", image_folder="{held.parent / "images"}", interval=2)'
    )
    config.write_text(sc.sub_once(config.read_text(), r'^(path = ".*"\n)', rf"\g<1>{line}\n"))
    return config


@pytest.fixture(scope="module")
def phi3_run(internvl) -> dict:
    """One real ``xtuner train`` of the packed Phi-3 config with the capture hook and the
    ``heldout`` shortcut (4 image samples of another seed, images in their own folder, and 4
    text-only samples that repeat training dialogues,
    evaluated every 2 iterations), shared by the isolation and held-out claims."""
    root = internvl["root"] / "phi3_run"
    held = write_llava_data(root / "held", n_images=4, n_text=4, seed=1)
    config = _config(internvl, ic.PHI3_FULL, "phi3", root / "phi3_full.py", packed=True)
    _with_heldout(config, held)
    return {"config": config, "held": held, "out": _train(config, root / "run"), "root": root}


def test_phi3_full_config_trains_packed_isolated_and_unpatched_rows_leak(internvl, phi3_run):
    config, tmp_path, out = phi3_run["config"], phi3_run["root"], phi3_run["out"]
    assert "ValidatedRoPEHook: 2 Phi3 attention layers" in out, out[-3000:]
    assert "PackedBatchCheckHook: first batch 1 rows x" in out, out[-3000:]
    saved = torch.load(tmp_path / "run" / INTERNVL_CAPTURE_FILE, weights_only=False)
    in_run = saved["in_run"]
    assert in_run["rows"] == 1 and in_run["samples"] == 4, in_run
    _assert_isolated(in_run)
    # Negative control: a row's first sample sees nothing before it; the others leak.
    firsts = [s for s in in_run["per_sample"] if s["start"] == 0]
    assert all(s["unpatched_max_abs_diff"] <= 1e-4 for s in firsts), firsts
    assert in_run["unpatched_max_abs_diff"] > 1e-2, in_run
    result = _fresh_compare(config, tmp_path / "run")
    _assert_isolated(result)
    print(
        f"InternVL Phi-3 full, packed: {result['samples']} samples "
        f"({_images_in(saved, internvl, 'phi3')} with an image) in {result['rows']} row, "
        f"max |trained - alone| {result['max_abs_diff']:.3g} (fresh process), "
        f"{in_run['max_abs_diff']:.3g} in the run; unpatched rows {in_run['unpatched_max_abs_diff']:.3g}"
    )


HELDOUT_REFERENCE = Path(__file__).parents[1] / "support" / "internvl_heldout_reference.py"


def test_phi3_heldout_loss_equals_each_sample_alone(phi3_run):
    """The shared packed Phi-3 run, evaluated at 2 and 4: the logged held-out loss at 4 equals
    each held-out sample alone through XTuner's ``InternVL_V1_5.forward`` with ``iter_4.pth``'s
    weights (a fresh process without the plugin), with the same supervised-token count."""
    assert "val_evaluator=dict(type=TokenLossMetric)" in phi3_run["out"]
    assert HELD_OUT_CHUNKED in phi3_run["out"]  # the held-out log-probs chunked
    # InternVL's dataset keeps no tokenized text: the start-up does not build every training
    # sample (images included) to count the overlap, and says so.
    assert "overlap with the training data not counted" in phi3_run["out"]
    work_dir = phi3_run["root"] / "run"
    ho.check_image_heldout(
        HELDOUT_REFERENCE, phi3_run["config"], work_dir, phi3_run["held"], [2, 4], samples=8
    )


def test_phi3_chunked_loss_equals_the_models_own(internvl, phi3_run):
    """Issue 57's opt-out pair for InternVL: the shared packed Phi-3 run (the LLM's loss chunked,
    logged; iteration 1 the capture's, the model's own in both) and the same run with
    ``chunked_loss=False`` give each of the 4 iterations' loss and the held-out loss at 2 and 4
    within 1e-6 relative, and the final weights (the LLM and ``mlp1``) and their change from the
    checkpoint (the warm-up's small steps: the weights' norm alone would hide a difference)
    within 1e-6 relative norm."""
    from opt_out import assert_logged, compare_runs

    own = phi3_run["root"] / "own"
    out = _train(phi3_run["config"], own, OPT_OUT)
    assert_logged(phi3_run["out"], out, CHUNKED_LINE)
    run = phi3_run["root"] / "run"
    compare_runs(run, own, "iter_4.pth", iters=4, heldout=(2, 4), start=internvl["phi3"])


@pytest.mark.skipif(not ho.BY_HAND, reason="opt-in (minutes): XTUNER_ROPE_HELDOUT_BY_HAND=1")
def test_phi3_heldout_on_two_processes_equals_each_sample_alone(internvl, tmp_path):
    """The packed Phi-3 config with the ``heldout`` shortcut on 2 processes: 7 held-out
    samples (4 image, 3 text-only), so the sampler pads one rank with a repeated sample; the
    logged loss at 4 equals each sample alone (fresh process, no plugin), every sample and
    supervised token counted once."""
    held = write_llava_data(tmp_path / "held", n_images=4, n_text=3, seed=1)
    config = _config(internvl, ic.PHI3_FULL, "phi3", tmp_path / "phi3_full.py", packed=True)
    _with_heldout(config, held)
    # 2 iterations an epoch on 2 processes: a warm-up of 0.3 epochs would round to none
    config.write_text(sc.sub_once(config.read_text(), r"^warmup_ratio = .*$", "warmup_ratio = 0.5"))
    options = ("train_cfg.max_epochs=None", "train_cfg.max_iters=4", "randomness.seed=0")
    out = ho.train_two_processes(config, tmp_path / "run", *options)
    assert "val_evaluator=dict(type=TokenLossMetric)" in out, out[-3000:]
    assert HELD_OUT_CHUNKED in out, out[-3000:]
    ho.check_image_heldout(HELDOUT_REFERENCE, config, tmp_path / "run", held, [2, 4], samples=7)
