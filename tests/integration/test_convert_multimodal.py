"""`xtuner-rope convert` of real multimodal LoRA / InternVL runs, loaded without the plugin.

Opt-in (``XTUNER_ROPE_CONVERT_BY_HAND=1``; about a minute each on 2 cores): the in-process
conversions of tests/outputs/test_internvl_convert.py prove the claims in CI; these runs give
the figures of docs/tools/convert.md. Each trains a stock config with the README's one edit
(``python -m xtuner.tools.train``, 1 process, warm-up 0.5 and lr 1e-2 so that the adapters
move), converts its last checkpoint with ``--dtype fp32`` and by default, and loads the folder in
a fresh process that never imports xtuner_rope (tests/support/multimodal_plain.py):

- the stock LLaVA QLoRA finetune (LoRA on the LLM and on CLIP, 4-bit dropped on CPU): both
  adapters and the projector bit for bit, logits of the peft-loaded pieces against XTuner's
  ``LLaVAModel`` with the checkpoint; ``convert merge --dtype fp32`` of both adapters;
- the stock InternVL InternLM2 LoRA and Phi-3 full finetunes: the official layout loaded by
  ``AutoModel``, weights against the trained module (LoRA merged by peft in fp32), logits; and
  XTuner's own ``convert_to_official.py`` on the same checkpoint, measured.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import converted
import internvl_configs as ic
import llava_configs as lc
import pytest
import stock_configs as sc
import torch
from mmengine.config import Config

from tools.zoo.localize import short_chat_samples
from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX

BY_HAND = os.environ.get("XTUNER_ROPE_CONVERT_BY_HAND") == "1"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not BY_HAND, reason="opt-in (minutes): XTUNER_ROPE_CONVERT_BY_HAND=1"),
]
PLAIN = Path(__file__).parents[1] / "support" / "multimodal_plain.py"
LLAVA_LORA = "llava_internlm2_chat_1_8b_qlora_clip_vit_large_p14_336_lora_e1_gpu8_finetune"
OFFICIAL = "xtuner/configs/internvl/v1_5/convert_to_official.py"
# bitsandbytes' triton probe answered False (see multimodal_plain._peft_importable), then a script.
RUN_WITH_PEFT = (
    "import runpy, sys, types; p = types.ModuleType('bitsandbytes.triton.triton_utils'); "
    "p.is_triton_available = lambda: False; sys.modules[p.__name__] = p; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _moving(text: str) -> str:
    """Warm-up over half the run and lr 1e-2: XTuner's warm-up of 0.3 rounds to one iteration
    and leaves the rate at 1e-5 of lr (MMEngine chains the schedulers)."""
    text = sc.sub_once(text, r"^warmup_ratio = .*$", "warmup_ratio = 0.5")
    return sc.sub_once(text, r"^lr = .*$", "lr = 1e-2")


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(cmd), cwd=sc.REPO, env=sc.venv_env(), capture_output=True, text=True, timeout=900
    )


def _train(config: Path, work_dir: Path, iters: int) -> Path:
    proc = _run(sys.executable, "-m", "xtuner.tools.train", str(config), "--work-dir",
                str(work_dir), "--cfg-options", "randomness.seed=0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work_dir / f"iter_{iters}.pth"


def _plain(kind: str, *args: object, data: dict, tmp: Path) -> dict:
    inputs, out = tmp / f"{kind}_inputs.pt", tmp / f"{kind}_out.pt"
    torch.save(data, inputs)
    proc = _run(sys.executable, str(PLAIN), kind, *map(str, args), str(inputs), str(out))
    assert proc.returncode == 0 and "PLAIN_OK" in proc.stdout, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _max_diff(a: dict, b: dict) -> tuple[float, int]:
    """Largest weight difference and the number of tensors that differ."""
    diffs = [(a[k].float() - b[k].float()).abs().max().item() for k in a]
    return max(diffs), sum(d > 0 for d in diffs)


def test_llava_lora_run_converted_and_merged(tmp_path):
    from xtuner.registry import BUILDER

    assets = lc.llava_assets(tmp_path / "assets")
    text = lc.localize_llava(sc.copy_stock(LLAVA_LORA, tmp_path), assets["llm"], assets["clip"],
                             assets["data"])  # fmt: skip
    config = tmp_path / "lora.py"
    config.write_text(lc.enable_plugin_llava(_moving(short_chat_samples(text, 32))))
    pth = _train(config, tmp_path / "run", 6)
    state = converted.read_as_xtuner(pth)
    for name, options in (("hf_fp32", ["--dtype", "fp32"]), ("hf", [])):
        assert "saving in fp32" in converted.convert(config, pth, tmp_path / name, *options)
        saved = converted.llava_saved_weights(tmp_path / name)
        assert saved.keys() == state.keys(), sorted(saved.keys() ^ state.keys())[:5]
        assert not converted.unequal(saved, state), options

    cfg = Config.fromfile(config)
    cfg.model.llm.torch_dtype = torch.float32  # as the start-up loaded it on CPU
    model = BUILDER.build(cfg.model).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not set(state) & set(missing)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (1, 24), generator=g)
    ids[0, 1] = IMAGE_TOKEN_INDEX
    data = {"input_ids": ids, "pixel_values": torch.randn(1, 3, 56, 56, generator=g)}
    with torch.no_grad():
        trained = model(copy.deepcopy(data), mode="tensor").logits
        with model.llm.disable_adapter(), model.visual_encoder.disable_adapter():
            without = model(copy.deepcopy(data), mode="tensor").logits
    out = tmp_path / "hf_fp32"
    plain = _plain("llava", out, assets["llm"], assets["clip"], data=data, tmp=tmp_path)
    diff = (plain["logits"] - trained).abs().max().item()
    moved = (without - trained).abs().max().item()
    print(f"LLaVA LoRA: adapters and projector bit for bit; peft-loaded logits {diff:.2e} off "
          f"(logits up to {trained.abs().max():.2f}; the adapters move them {moved:.2f})")  # fmt: skip
    assert diff <= 1e-6 and moved > 1e-1

    from xtuner_rope.cli import main

    assert main(["convert", "merge", str(assets["llm"]), str(out / "llm_adapter"),
                 str(tmp_path / "m_llm"), "--dtype", "fp32"]) == 0  # fmt: skip
    assert main(["convert", "merge", str(assets["clip"]), str(out / "visual_encoder_adapter"),
                 str(tmp_path / "m_clip"), "--is-clip", "--dtype", "fp32"]) == 0  # fmt: skip
    merged = _plain("llava-merged", tmp_path / "m_llm", tmp_path / "m_clip", out / "projector",
                    data=data, tmp=tmp_path)  # fmt: skip
    merged_diff = (merged["logits"] - trained).abs().max().item()
    print(f"LLaVA LoRA merged at fp32 (LLM and CLIP): logits {merged_diff:.2e} off")
    assert merged_diff <= 1e-5 * trained.abs().max().item()


def _internvl_reference(config: Path, pth: Path):
    """The trained module (fp32, eager), its logits on one image row, its chat model's weights
    with LoRA merged by peft in fp32; and the row."""
    from xtuner.registry import BUILDER

    from xtuner_rope.compat.xtuner_internvl import INTERNVL_LOAD

    kept = dict(INTERNVL_LOAD)
    INTERNVL_LOAD.update(torch_dtype=torch.float32, attn_implementation="eager")
    try:
        model = BUILDER.build(Config.fromfile(config).model).float().eval()
    finally:
        INTERNVL_LOAD.clear()
        INTERNVL_LOAD.update(kept)
    state = converted.read_as_xtuner(pth)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not set(state) & set(missing)
    chat = model.model
    side = chat.config.force_image_size or chat.config.vision_config.image_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (1, 30), generator=g)
    image = torch.full((1, int(chat.num_image_token)), int(chat.img_context_token_id))
    data = {"input_ids": torch.cat([ids[:, :2], image, ids[:, 2:]], dim=1),
            "pixel_values": torch.randn(1, 3, side, side, generator=g)}  # fmt: skip
    with torch.no_grad():
        trained = chat(**data, image_flags=torch.ones(1, dtype=torch.long)).logits
    if model.use_llm_lora:
        chat.language_model = chat.language_model.merge_and_unload()
    return trained, chat.state_dict(), data


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_internvl_run_converted_to_the_official_layout(kind, tmp_path):
    assets = ic.internvl_assets(tmp_path / "assets")
    stock, model_dir = (
        (ic.INTERNLM2_LORA, assets["internlm2"])
        if kind == "lora"
        else (ic.PHI3_FULL, assets["phi3"])
    )
    text = ic.localize_internvl(assets[stock], model_dir, assets["data"])
    config = tmp_path / f"{kind}.py"
    config.write_text(ic.enable_plugin_internvl(_moving(text)))
    pth = _train(config, tmp_path / "run", 4)
    trained, expected, data = _internvl_reference(config, pth)
    for name, options in (("hf_fp32", ["--dtype", "fp32"]), ("hf", [])):
        assert "saving in fp32" in converted.convert(config, pth, tmp_path / name, *options)
        plain = _plain("internvl", tmp_path / name, data=data, tmp=tmp_path)
        assert not any(plain["info"].values()), plain["info"]
        assert plain["state"].keys() == expected.keys()
        assert not converted.unequal(plain["state"], expected), options
        diff = (plain["logits"] - trained).abs().max().item()
        assert diff <= 1e-5 * trained.abs().max().item(), diff
    print(f"InternVL {kind}: xtuner-rope convert: weights bit for bit, logits {diff:.2e} off "
          f"(logits up to {trained.abs().max():.2f})")  # fmt: skip

    # XTuner's own script on the same checkpoint (peft importable, as any user here needs).
    import xtuner

    script = Path(xtuner.__file__).parent / OFFICIAL.removeprefix("xtuner/")
    official = tmp_path / "official"
    proc = _run(sys.executable, "-c", RUN_WITH_PEFT, str(script), str(config), str(pth),
                str(official))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (official / "modeling_internvl_chat.py").exists()  # AutoModel cannot load it
    for code in model_dir.glob("modeling_*.py"):  # the user's repair: the remote code copied
        shutil.copyfile(code, official / code.name)
    config_json = (official / "config.json").read_text()
    forced = '"attn_implementation": "flash_attention_2"' in config_json
    if forced:  # the user's other repair without flash-attn: the LLM's attention back to eager
        (official / "config.json").write_text(config_json.replace('"flash_attention_2"', '"eager"'))
    plain = _plain("internvl", official, data=data, tmp=tmp_path)
    weights, tensors = _max_diff(plain["state"], expected)
    diff = (plain["logits"] - trained).abs().max().item()
    print(
        f"InternVL {kind}: XTuner's convert_to_official (bf16, no remote code saved"
        f"{', flash_attention_2 kept' if forced else ''}): weights {weights:.2e} off in "
        f"{tensors} of {len(expected)} tensors, logits {diff:.2e} off"
    )
    assert weights > 0  # bf16: the reason xtuner-rope converts InternVL itself
