"""XTuner's stock LLaVA configs with the README's one edit, on a tiny CLIP + tiny LLMs.

One real ``xtuner train`` per claim (copied with ``xtuner copy-cfg``, the user's own-machine
edits of ``llava_configs.localize_llava``, the edit after ``llm_name_or_path``), on drawn
images plus short text-only dialogues, with ``LLaVAIsolationCaptureHook`` recording the LLM's
inputs and logits of iteration 1:

- the InternLM2 finetune config, padded rows (XTuner's collate): each sample equals itself
  alone through the unpatched LLM (offline, ``compare_llava_capture``); the stock
  ``EvaluateChatHook`` generates for its image prompt; the same run has the ``heldout``
  shortcut, and its logged held-out loss at iteration 6 equals each held-out sample alone
  through XTuner's ``LLaVAModel`` with ``iter_6.pth`` in a fresh process without the plugin
  (``tests/support/llava_heldout_reference.py``);
- the InternLM2 pretrain config (fp16 LLM switched to fp32 on CPU, LLM frozen), rows packed by
  ``llava_collate_fn``: isolation measured inside the run, and the negative control (the same
  packed rows through the unpatched LLM leak);
- the Llama 3 finetune config on a tiny transformers Llama, packed: the same in-run figures.

The other claims (the user's ``pretrained_model_name_or_path = llm_name_or_path`` line,
InternVL's QLoRA refusal on CPU) run XTuner's own start-up (``set_model_resource``) without training, and the batch
checks run on hand-made batches.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import heldout as ho
import llava_configs as lc
import pytest
import stock_configs as sc
import torch
from mmengine.config import Config
from opt_in import again
from opt_out import EVERY_ITERATION

from tools.zoo.localize import short_chat_samples
from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX, check_batch_with_images
from xtuner_rope.compat import devices
from xtuner_rope.compat.mmengine_config import config_dict
from xtuner_rope.config import startup
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.demo.llava_data import write_llava_data
from xtuner_rope.demo.runlog import check_run
from xtuner_rope.demo.tiny_clip import image_tokens, save_tiny_clip
from xtuner_rope.models.llava import check_expanded_batch

CAPTURE = "from xtuner_rope.capture.llava import LLaVAIsolationCaptureHook\n"
HELDOUT_REFERENCE = Path(__file__).parents[1] / "support" / "llava_heldout_reference.py"
# The start-up line of the chunked training loss (hooks.chunked_loss): the LLM inside LLaVA.
CHUNKED_LINE = "xtuner-rope: chunked loss: the training loss projects only the supervised tokens"
HELD_OUT_CHUNKED = "the held-out log-probs too; opt out: chunked_loss = False"  # docs/loss.md


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llava")
    sc.ensure_tiny_model()
    return {
        "root": root,
        "llm": sc.tiny_with_remote_code(root / "tiny-internlm2-remote"),
        "clip": save_tiny_clip(root / "tiny-clip"),
        "data": write_llava_data(root / "data", n_images=12, n_text=12),
        "finetune": sc.copy_stock(lc.FINETUNE, root),
        "pretrain": sc.copy_stock(lc.PRETRAIN, root),
    }


def _short_chat(text: str) -> str:
    """``EvaluateChatHook`` generates 32 tokens, not its default 600 (a short trial)."""
    assert "type=EvaluateChatHook," in text  # the stock hook whose generation is checked
    return short_chat_samples(text, 32)


def _config(llava: dict, name: str, path: Path, alias: bool = False) -> Path:
    text = lc.localize_llava(llava[name], llava["llm"], llava["clip"], llava["data"])
    path.write_text(lc.enable_plugin_llava(_short_chat(text), with_pretrained_alias=alias))
    return path


def _started(*configs: Path) -> list[dict]:
    """XTuner's own start-up (``set_model_resource``) in one fresh process: the paths after it."""
    code = (
        "import json, sys; from mmengine.config import Config; "
        "from xtuner.tools.utils import set_model_resource\n"
        "for path in sys.argv[1:]:\n"
        "    cfg = Config.fromfile(path); set_model_resource(cfg); d = cfg._cfg_dict\n"
        "    print('PATHS=' + json.dumps({'llm': d.model.llm.pretrained_model_name_or_path, "
        "'clip': d.model.visual_encoder.pretrained_model_name_or_path, "
        "'processor': d.image_processor.pretrained_model_name_or_path, "
        "'tokenizer': d.tokenizer.pretrained_model_name_or_path, "
        "'llm_dtype': str(d.model.llm.torch_dtype)}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, configs)],
        capture_output=True,
        text=True,
        env=sc.venv_env(),
        timeout=300,
        cwd=sc.REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [
        json.loads(x.removeprefix("PATHS="))
        for x in proc.stdout.splitlines()
        if x.startswith("PATHS=")
    ]


FINETUNE_OPTIONS = ("randomness.seed=0", *EVERY_ITERATION)


@pytest.fixture(scope="module")
def finetune_run(llava) -> dict:
    """One real ``xtuner train`` of the finetune config with the edit, the capture hook and
    the ``heldout`` shortcut (6 image samples of another seed, images in their own folder, and
    6 text-only samples that repeat training dialogues, evaluated every 3 iterations), shared by the isolation and held-out claims."""
    root = llava["root"] / "finetune_run"
    held = write_llava_data(root / "held", n_images=6, n_text=6, seed=1)
    config = _with_heldout(_with_capture(_config(llava, "finetune", root / "finetune.py")), held, 3)
    proc = sc.xtuner_train(config, root / "run", *FINETUNE_OPTIONS)
    return {
        "config": config,
        "held": held,
        "work_dir": root / "run",
        "out": proc.stdout + proc.stderr,
    }


def _converted_equals_checkpoint(config: Path, work_dir: Path) -> None:
    """``xtuner-rope convert pth_to_hf`` of the run's ``iter_6.pth`` (in this process: seconds),
    with ``--fp32`` and by default (the run trained in fp32): what it saves (``projector/``, and
    the LLM when it trained) is the checkpoint's weights bit for bit."""
    import converted

    checkpoint = work_dir / "iter_6.pth"
    state = converted.read_as_xtuner(checkpoint)
    for name, options in (("hf_fp32", ["--fp32"]), ("hf", [])):
        printed = converted.convert(config, checkpoint, work_dir / name, *options)
        assert "saving in fp32" in printed, printed
        saved = converted.llava_saved_weights(work_dir / name)
        assert saved.keys() == state.keys(), sorted(saved.keys() ^ state.keys())[:5]
        assert not converted.unequal(saved, state), options


def test_stock_finetune_trains_with_one_edit_and_isolates_samples(finetune_run):
    config, tmp_path, out = (
        finetune_run["config"],
        finetune_run["work_dir"].parent,
        finetune_run["out"],
    )
    run = check_run(tmp_path / "run", min_iters=6)
    assert "pretrained_model_name_or_path: missing (a LLaVA/InternVL config names its LLM" in out
    assert "custom_hooks: EvaluateChatHook" not in out  # kept (compat fixes its generation)
    assert_chat_hook_generated(tmp_path / "run")
    assert "ValidatedRoPEHook: 2 InternLM2 attention layers" in out
    assert CHUNKED_LINE in out, out[-3000:]  # iteration 1 paused for the capture, then chunked
    assert "the sequence its LLM sees after the image expansion is checked every step" in out
    assert "LLaVAIsolationCaptureHook: saved" in out, out[-3000:]
    from xtuner_rope.capture.llava import LLAVA_CAPTURE_FILE, compare_llava_capture

    result = compare_llava_capture(config, tmp_path / "run" / LLAVA_CAPTURE_FILE)
    saved = torch.load(tmp_path / "run" / LLAVA_CAPTURE_FILE, weights_only=False)
    lengths = saved["attention_mask"].sum(dim=1)
    assert result["samples"] == 4 and len(set(lengths.tolist())) > 1, lengths  # padded rows
    for sample in result["per_sample"]:
        assert sample["max_abs_diff"] <= 1e-5 * max(1.0, sample["max_abs_logit"]), sample
    assert abs(result["loss"]["captured"] - result["loss"]["samples"]) <= 1e-5, result["loss"]
    print(
        f"LLaVA finetune: {result['samples']} samples, max |trained - alone| "
        f"{result['max_abs_diff']:.3g}, losses {run.losses}"
    )


@again("tests/models/test_chunked_loss_multimodal.py::test_llava_chunked_loss_*")
def test_stock_finetune_chunked_loss_equals_the_models_own(llava, finetune_run):
    """Issue 57's opt-out pair for LLaVA: the shared finetune run (padded rows, the LLM's loss
    chunked, logged; iteration 1 the capture's, the model's own in both) and the same run with
    ``chunked_loss=False`` give each of the 6 iterations' loss and the held-out loss at 3 and 6
    within 1e-6 relative, and the final trained weights (the LLM and the projector) and the
    LLM's change from its checkpoint (its warm-up's small steps: the weights' norm alone would
    hide a difference) within 1e-6 relative norm."""
    from opt_out import OPT_OUT, assert_logged, compare_runs

    work = finetune_run["work_dir"]
    own = work.parent / "own"
    proc = sc.xtuner_train(finetune_run["config"], own, *FINETUNE_OPTIONS, OPT_OUT)
    assert_logged(finetune_run["out"], proc.stdout + proc.stderr, CHUNKED_LINE)
    compare_runs(work, own, "iter_6.pth", iters=6, heldout=(3, 6), start=llava["llm"])


def assert_chat_hook_generated(work_dir: Path, assistant: str = "<|im_start|>assistant\n") -> None:
    """XTuner's ``EvaluateChatHook`` generated for the image prompt, before and after training:
    each ``Sample output:`` holds the prompt (``<image>``, the question) and new text after it."""
    log = sorted(work_dir.glob("*/*.log"))[-1].read_text()
    samples = log.split(" - INFO - Sample output:\n")[1:]
    assert len(samples) >= 2, log[-3000:]  # before_train and after_train at least
    for sample in samples:
        prompt, _, reply = sample.partition(assistant)  # the template's assistant turn
        assert "<image>\nWhat is this?" in prompt, sample[:500]
        assert reply.split("\n20")[0].strip(), sample[:500]  # up to the next log line


def _with_capture(config: Path) -> Path:
    text = sc.sub_once(
        config.read_text(),
        r"^(custom_hooks = \[)$",
        r"\g<1>\n    dict(type=LLaVAIsolationCaptureHook),",
    )
    config.write_text(sc.sub_once(text, r"^(from xtuner.utils import .*\n)", r"\g<1>" + CAPTURE))
    return config


def _packed(config: Path) -> Path:
    """``llava_collate_fn`` instead of XTuner's ``default_collate_fn`` (rows packed)."""
    text = sc.sub_once(
        config.read_text(),
        r"collate_fn=dict\(type=default_collate_fn\)",
        "collate_fn=dict(type=llava_collate_fn, max_length=256, image_tokens=16)",
    )
    config.write_text(
        sc.sub_once(
            text,
            r"^(from xtuner.utils import .*\n)",
            r"\g<1>from xtuner_rope import llava_collate_fn\n",
        )
    )
    return config


def _assert_in_run_isolation(work_dir: Path) -> dict:
    """The capture hook's in-run figures: each packed sample equals itself alone through the
    unpatched LLM (<= 1e-5 relative), the same rows through the unpatched LLM leak (> 1e-2)."""
    from xtuner_rope.capture.llava import LLAVA_CAPTURE_FILE

    result = torch.load(work_dir / LLAVA_CAPTURE_FILE, weights_only=False)["in_run"]
    assert result["rows"] < result["samples"], result  # rows really packed
    for sample in result["per_sample"]:
        assert sample["max_abs_diff"] <= 1e-5 * max(1.0, sample["max_abs_logit"]), sample
    assert abs(result["loss"]["captured"] - result["loss"]["samples"]) <= 1e-5, result["loss"]
    # Negative control: a row's first sample sees nothing before it; the others leak.
    firsts = [s for s in result["per_sample"] if s["start"] == 0]
    assert all(s["unpatched_max_abs_diff"] <= 1e-5 for s in firsts), firsts
    assert result["unpatched_max_abs_diff"] > 1e-2, result
    return result


def _with_heldout(config: Path, held: Path, interval: int) -> Path:
    """The ``heldout`` shortcut after ``max_length``: ``held``'s samples, its images."""
    line = (
        f'heldout = dict(data_files="{held}", image_folder="{held.parent / "images"}", '
        f"interval={interval})"
    )
    config.write_text(sc.sub_once(config.read_text(), r"^(max_length = .*\n)", rf"\g<1>{line}\n"))
    return config


def test_stock_pretrain_trains_packed_isolated_and_unpatched_rows_leak(llava, tmp_path):
    """The stock pretrain config (LLM frozen and loaded fp16, projector trained) with the edit,
    its samples packed by ``llava_collate_fn``, through the real ``xtuner train``. Inside the
    run the capture hook measures each packed sample against itself alone through an unpatched
    copy of the LLM with the run's weights, and the same packed rows through that unpatched
    LLM: the negative control, which must leak. The same run has the ``heldout`` shortcut
    (6 image + 6 text-only samples, every 3 iterations, packed like training): its logged
    held-out loss at 6 equals each held-out sample alone through XTuner's unpatched
    ``LLaVAModel`` with ``iter_6.pth``'s projector (a fresh process without the plugin)."""
    held = write_llava_data(tmp_path / "held", n_images=6, n_text=6, seed=1)
    config = _with_heldout(_packed(_config(llava, "pretrain", tmp_path / "pretrain.py")), held, 3)
    proc = sc.xtuner_train(_with_capture(config), tmp_path / "run", "randomness.seed=0")
    out = proc.stdout + proc.stderr
    run = check_run(tmp_path / "run", min_iters=6)
    assert "model.llm.torch_dtype: float16 on this CPU-only machine" in out, out[-3000:]
    assert "PackedBatchCheckHook: first batch 1 rows x" in out, out[-3000:]
    assert "LLaVAIsolationCaptureHook: saved" in out, out[-3000:]
    assert_chat_hook_generated(tmp_path / "run")  # the stock hook, on the patched packed model
    result = _assert_in_run_isolation(tmp_path / "run")
    assert result["rows"] == 1 and result["samples"] == 4, result  # one packed row
    print(
        f"LLaVA pretrain, packed: {result['samples']} samples in {result['rows']} row(s), "
        f"max |trained - alone| {result['max_abs_diff']:.3g}, unpatched rows "
        f"{result['unpatched_max_abs_diff']:.3g}, losses {run.losses}"
    )
    assert "val_evaluator=dict(type=TokenLossMetric)" in out, out[-3000:]
    ho.check_image_heldout(HELDOUT_REFERENCE, config, tmp_path / "run", held, [3, 6], 12)
    _converted_equals_checkpoint(config, tmp_path / "run")  # the projector


LLAMA_FINETUNE = "llava_llama3_8b_instruct_full_clip_vit_large_p14_336_e1_gpu8_finetune"


@pytest.fixture(scope="module")
def llama_llm(llava) -> Path:
    from xtuner_rope.demo.tiny import save_tiny

    return save_tiny(llava["root"] / "tiny-llama", "llama", sc.SAMPLE_DATA)


def test_stock_llama3_llava_finetune_trains_packed_and_isolated(llava, llama_llm, tmp_path):
    """XTuner's Llama 3 LLaVA finetune config (full LLM trained) on a tiny transformers Llama,
    packed by ``llava_collate_fn``, through the real ``xtuner train``: isolation and the
    negative control measured inside the run, as for InternLM2."""
    stock = sc.copy_stock(LLAMA_FINETUNE, tmp_path)
    text = lc.localize_llava(stock, llama_llm, llava["clip"], llava["data"])
    config = tmp_path / "llama_finetune.py"
    config.write_text(lc.enable_plugin_llava(_short_chat(text)))
    proc = sc.xtuner_train(_with_capture(_packed(config)), tmp_path / "run", "randomness.seed=0")
    out = proc.stdout + proc.stderr
    run = check_run(tmp_path / "run", min_iters=6)
    assert "ValidatedRoPEHook: 2 Llama attention layers" in out, out[-3000:]
    assert CHUNKED_LINE in out, out[-3000:]
    assert "LLaVAIsolationCaptureHook: saved" in out, out[-3000:]
    assert_chat_hook_generated(tmp_path / "run", "<|start_header_id|>assistant<|end_header_id|>")
    result = _assert_in_run_isolation(tmp_path / "run")
    print(
        f"LLaVA Llama 3 finetune, packed: {result['samples']} samples in {result['rows']} "
        f"row(s), max |trained - alone| {result['max_abs_diff']:.3g}, unpatched rows "
        f"{result['unpatched_max_abs_diff']:.3g}, losses {run.losses}"
    )


def test_user_alias_line_keeps_clip_paths(llava, tmp_path):
    """The finetune config with the user's ``pretrained_model_name_or_path = llm_name_or_path``
    line too: XTuner's start-up keeps the CLIP encoder's and image processor's paths."""
    assert devices.cpu_only()
    (alias,) = _started(_config(llava, "finetune", tmp_path / "alias.py", alias=True))
    assert alias["llm"] == alias["tokenizer"] == str(llava["llm"])
    assert alias["clip"] == alias["processor"] == str(llava["clip"])


def test_internvl_qlora_config_is_refused_on_cpu_at_start_up():
    """InternVL configs are served (``tests/integration/test_internvl.py``); their 4-bit
    quantization needs a GPU: refused on a CPU-only machine before the weights load."""
    from xtuner.configs import cfgs_name_path  # the file `xtuner copy-cfg` copies

    cfg = Config.fromfile(cfgs_name_path["internvl_v2_internlm2_2b_qlora_finetune"])
    assert devices.cpu_only()
    with pytest.raises(
        ConfigConflict,
        match="model.quantization_llm: True on this CPU-only machine: bitsandbytes' 4-bit",
    ):
        startup.prepare_config(cfg)


def test_internvl_xtuner_train_with_the_edit_is_refused_not_a_key_error(tmp_path):
    """The real `xtuner train` of a copied InternVL QLoRA config with the edit stops at the
    start-up on CPU, naming the setting.

    InternVL configs name their model ``path`` (no ``pretrained_model_name_or_path``): without
    compat's fallback XTuner's ``set_model_resource`` dies with ``KeyError`` before the plugin
    can say what to change.
    """
    from xtuner.configs import cfgs_name_path

    text = Path(cfgs_name_path["internvl_v2_internlm2_2b_qlora_finetune"]).read_text()
    config = tmp_path / "internvl.py"
    config.write_text(sc.sub_once(text, r"^(path = .*\n)", r"\g<1>" + sc.PLUGIN_EDIT))
    env = {**os.environ, "PYTHONPATH": str(sc.REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "xtuner.tools.train", str(config), "--work-dir", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "KeyError" not in out, out[-3000:]
    assert "model.quantization_llm: True on this CPU-only machine" in out, out[-3000:]
    assert "set to path = " in out, out[-3000:]


def _image_batch(placeholders, images):
    ids = torch.randint(3, 100, (len(placeholders), 12))
    for r, n in enumerate(placeholders):
        ids[r, 2 : 2 + n] = IMAGE_TOKEN_INDEX
    labels = ids.masked_fill(ids == IMAGE_TOKEN_INDEX, -100)
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids).bool(),
        "pixel_values": torch.zeros(images, 3, 8, 8),
    }


def test_batch_check_counts_image_placeholders():
    check_batch_with_images(_image_batch([1, 0, 1], 3), vocab_size=1024)  # no tokenizer hint
    with pytest.raises(
        ValueError,
        match=r"row 1 \(sample 1\), field 'input_ids': 2 image "
        r"placeholder\(s\) \(-200\), but field 'pixel_values' has 2 image",
    ):
        check_batch_with_images(_image_batch([1, 2], 2), vocab_size=1024)
    with pytest.raises(
        ValueError,
        match=r"field 'pixel_values': 3 image\(s\), but the 2 "
        r"row\(s\) take 2 .*placeholders per row \[1, 0\]",
    ):
        check_batch_with_images(_image_batch([1, 0], 3), vocab_size=1024)
    with pytest.raises(ValueError, match=r"field 'input_ids': expected ids in \[0, 50\)"):
        check_batch_with_images(_image_batch([1, 0], 2), vocab_size=50)


def test_expanded_sequence_is_checked_as_the_llm_sees_it():
    n = image_tokens()
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, :40], mask[1, :25] = True, True
    positions = torch.arange(40).expand(2, 40) * mask
    out = {
        "inputs_embeds": torch.zeros(2, 40, 8),
        "attention_mask": mask,
        "position_ids": positions,
    }
    check_expanded_batch(out, max_position=64)
    with pytest.raises(
        ValueError,
        match=r"after the image expansion\): row 0, field "
        r"'position_ids': expected positions < max_position=32 \(the RoPE "
        r"range\), got 40 tokens after the images were expanded",
    ):
        check_expanded_batch(out, max_position=32)
    mask[1] = False
    with pytest.raises(ValueError, match=r"row 1, field 'attention_mask': expected at least one"):
        check_expanded_batch(out)
    assert n == 16


def test_tiny_clip_and_llava_data_are_deterministic(tmp_path):
    from safetensors.torch import load_file

    a, b = save_tiny_clip(tmp_path / "a"), save_tiny_clip(tmp_path / "b")
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ja = write_llava_data(tmp_path / "da", n_images=3, n_text=3)
    jb = write_llava_data(tmp_path / "db", n_images=3, n_text=3)
    assert ja.read_text() == jb.read_text()
    rows = json.loads(ja.read_text())
    assert sum("image" in r for r in rows) == 3 and "image" in rows[0]
    assert all(
        (ja.parent / "images" / r["image"]).read_bytes()
        == (jb.parent / "images" / r["image"]).read_bytes()
        for r in rows
        if "image" in r
    )


def test_in_process_start_up_gets_the_llm_path(llava, tmp_path):
    """Where xtuner_rope is imported first (the doctor, check, replay start configs in process),
    XTuner's ``set_model_resource`` still finds the LLM path and keeps the CLIP paths."""
    import xtuner.tools.utils as xtuner_utils

    cfg = Config.fromfile(str(_config(llava, "finetune", tmp_path / "in_process.py")))
    state = dict(startup._STATE)
    try:
        xtuner_utils.set_model_resource(cfg)
    finally:
        startup._STATE.update(state)
    d = config_dict(cfg)
    assert (
        d.pretrained_model_name_or_path
        == d.model.llm.pretrained_model_name_or_path
        == str(llava["llm"])
    )
    assert d.model.visual_encoder.pretrained_model_name_or_path == str(llava["clip"])
    assert d.image_processor.pretrained_model_name_or_path == str(llava["clip"])


def test_stock_finetune_heldout_loss_equals_each_sample_alone(finetune_run):
    """The shared finetune run, evaluated at 3 and 6: the logged held-out loss at 6 equals each
    held-out sample alone through XTuner's unpatched LLaVA model with ``iter_6.pth``'s weights
    (a fresh process without the plugin), with the same supervised-token count."""
    work_dir = finetune_run["work_dir"]
    check_run(work_dir, min_iters=6)
    assert "val_evaluator=dict(type=TokenLossMetric)" in finetune_run["out"]
    assert HELD_OUT_CHUNKED in finetune_run["out"]  # the held-out log-probs chunked
    ho.check_image_heldout(
        HELDOUT_REFERENCE, finetune_run["config"], work_dir, finetune_run["held"], [3, 6], 12
    )
    _converted_equals_checkpoint(finetune_run["config"], work_dir)  # the LLM and projector


@pytest.mark.skipif(not ho.BY_HAND, reason="opt-in (minutes): XTUNER_ROPE_HELDOUT_BY_HAND=1")
def test_stock_finetune_heldout_on_two_processes_equals_each_sample_alone(llava, tmp_path):
    """The finetune config with the ``heldout`` shortcut on 2 processes (padded rows, as
    shipped): 11 held-out samples (6 image, 5 text-only), so the sampler pads one rank with a
    repeated sample; the logged loss at 6 equals each sample alone (fresh process, no plugin),
    every sample and supervised token counted once."""
    held = write_llava_data(tmp_path / "held", n_images=6, n_text=5, seed=1)
    config = _with_heldout(_config(llava, "finetune", tmp_path / "finetune.py"), held, 3)
    # 3 iterations an epoch on 2 processes: a warm-up of 0.3 epochs would round to none
    config.write_text(sc.sub_once(config.read_text(), r"^warmup_ratio = .*$", "warmup_ratio = 0.5"))
    options = ("train_cfg.max_epochs=None", "train_cfg.max_iters=6", "randomness.seed=0")
    out = ho.train_two_processes(config, tmp_path / "run", *options)
    assert "val_evaluator=dict(type=TokenLossMetric)" in out, out[-3000:]
    assert HELD_OUT_CHUNKED in out, out[-3000:]
    ho.check_image_heldout(HELDOUT_REFERENCE, config, tmp_path / "run", held, [3, 6], 11)
