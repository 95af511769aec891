"""`xtuner-rope convert pth_to_hf` of multimodal LoRA checkpoints, in process (seconds each).

The models are XTuner's own, built from its stock configs (localized as a user does, 4-bit
quantization dropped on CPU) in fp32 as the start-up builds them on CPU; their LoRA ``B`` weights
are drawn (a fresh adapter's are zero and would hide a wrong merge or a missing adapter); the
checkpoint is written as MMEngine's runner writes ``iter_N.pth`` (``model.state_dict()`` under
``state_dict``). The converted folders are loaded with transformers' and peft's own classes and
compared with the module: weights bit for bit at fp32 (LoRA: against peft's fp32 merge of the
module), logits equal. The real runs (`xtuner train`, a fresh process without the plugin) are
opt-in: tests/integration/test_convert_multimodal.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import converted
import internvl_configs as ic
import llava_configs as lc
import pytest
import stock_configs as sc
import torch
from mmengine.config import Config

from xtuner_rope.cli import main

LLAVA_LORA = "llava_internlm2_chat_1_8b_qlora_clip_vit_large_p14_336_lora_e1_gpu8_finetune"


def _draw_lora_b(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every LoRA ``B`` weight drawn values (a fresh adapter's are zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)


def _save_as_runner(model: torch.nn.Module, path: Path) -> dict:
    """``iter_N.pth`` as MMEngine's ``Runner.save_checkpoint`` writes it; the state saved."""
    from mmengine.runner.checkpoint import weights_to_cpu

    state = weights_to_cpu(model.state_dict())
    torch.save({"meta": {}, "state_dict": state}, path)
    return state


def _with_vit_lora(text: str) -> str:
    """The stock config's commented-out ``visual_encoder_lora`` turned on (a user's edit)."""
    return sc.sub_once(
        text, r"    # (visual_encoder_lora=dict\(\n)    # (.*\n)    # (.*\n)", r"    \1    \2    \3"
    )


@pytest.fixture(scope="module", params=["llm", "llm+vit"])
def internvl_lora(request, tmp_path_factory) -> dict:
    """The stock InternVL InternLM2 LoRA config on the tiny InternVL (``llm+vit``: its
    commented-out InternViT LoRA on too), its model as the CPU start-up builds it (fp32, eager),
    adapters drawn, saved as ``iter_4.pth``."""
    from xtuner.registry import BUILDER

    from xtuner_rope.compat.xtuner_internvl import INTERNVL_LOAD
    from xtuner_rope.demo.llava_data import write_llava_data
    from xtuner_rope.demo.tiny_internvl import save_tiny_internvl

    root = tmp_path_factory.mktemp("internvl_convert")
    sc.ensure_tiny_model()
    path = save_tiny_internvl(sc.tiny_with_remote_code(root / "llm"), root / "internvl")
    data = write_llava_data(root / "data", n_images=1, n_text=1)
    text = ic.localize_internvl(sc.copy_stock(ic.INTERNLM2_LORA, root), path, data)
    config = root / "lora.py"
    if request.param == "llm+vit":
        text = _with_vit_lora(text)
    config.write_text(ic.enable_plugin_internvl(text))
    kept = dict(INTERNVL_LOAD)
    INTERNVL_LOAD.update(torch_dtype=torch.float32, attn_implementation="eager")
    try:
        torch.manual_seed(0)
        model = BUILDER.build(Config.fromfile(config).model)
    finally:
        INTERNVL_LOAD.clear()
        INTERNVL_LOAD.update(kept)
    _draw_lora_b(model)
    assert model.use_visual_encoder_lora == (request.param == "llm+vit")
    pth = root / "iter_4.pth"
    _save_as_runner(model, pth)
    model = model.float().eval()
    return {"root": root, "config": config, "pth": pth, "model": model, "kind": request.param}


def _internvl_inputs(chat) -> dict:
    """One row: text, one tile's ``<IMG_CONTEXT>`` ids, text; and the tile."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (1, 20), generator=g)
    image = torch.full((1, int(chat.num_image_token)), int(chat.img_context_token_id))
    side = chat.config.force_image_size or chat.config.vision_config.image_size
    return {
        "input_ids": torch.cat([ids[:, :2], image, ids[:, 2:]], dim=1),  # [1, s]
        "pixel_values": torch.randn(1, 3, side, side, generator=g),  # [tiles, 3, H, W]
        "image_flags": torch.ones(1, dtype=torch.long),
    }


def _load_official(folder: Path):
    """The converted folder as a user loads it: ``AutoModel`` with its remote code."""
    from transformers import AutoModel, AutoTokenizer

    model, info = AutoModel.from_pretrained(
        folder, trust_remote_code=True, torch_dtype=torch.float32, output_loading_info=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model.img_context_token_id = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.eval()


def test_internvl_lora_converted_to_the_official_layout_exactly(internvl_lora):
    model, root = internvl_lora["model"], internvl_lora["root"]
    out = root / "hf_fp32"
    printed = converted.convert(
        internvl_lora["config"], internvl_lora["pth"], out, "--dtype", "fp32"
    )
    assert "saving in fp32 (asked)" in printed and "official InternVL layout" in printed, printed
    assert (out / "modeling_internvl_chat.py").is_file()  # loadable with its remote code
    saved = _load_official(out)
    chat = model.model
    inputs = _internvl_inputs(chat)
    with torch.no_grad():
        trained = chat(**inputs).logits  # [1, s, V], the module with its adapter
        reference = copy.deepcopy(chat)
        reference.language_model = reference.language_model.merge_and_unload()  # peft, fp32
        if model.use_visual_encoder_lora:
            reference.vision_model = reference.vision_model.merge_and_unload()
        logits = saved(**inputs).logits
    expected = reference.state_dict()
    weights = saved.state_dict()
    assert weights.keys() == expected.keys(), sorted(weights.keys() ^ expected.keys())[:5]
    assert not converted.unequal(weights, expected)  # bit for bit
    diff = (logits - trained).abs().max().item()
    print(
        f"InternVL LoRA ({internvl_lora['kind']}) converted at fp32: max |logits - trained| {diff:.2e}"
    )
    assert diff <= 1e-5 * trained.abs().max().item()  # the merge sums in another order
    # The LLM config keeps the checkpoint's attention, not XTuner's forced flash_attention_2.
    assert saved.config.llm_config.attn_implementation != "flash_attention_2"

    out16 = root / "hf_bf16"
    converted.convert(internvl_lora["config"], internvl_lora["pth"], out16, "--dtype", "bf16")
    assert '"torch_dtype": "bfloat16"' in (out16 / "config.json").read_text()
    from transformers import AutoModel

    bf16 = AutoModel.from_pretrained(out16, trust_remote_code=True, torch_dtype=torch.bfloat16)
    assert not converted.unequal(bf16.state_dict(), expected, cast=torch.bfloat16)


def test_internvl_checkpoint_of_another_config_is_refused(internvl_lora, tmp_path, capsys):
    pth = tmp_path / "iter_1.pth"
    state = torch.load(internvl_lora["pth"], weights_only=False)
    state["state_dict"]["model.mlp1.extra.weight"] = torch.zeros(1)
    torch.save(state, pth)
    args = ["convert", "pth_to_hf", str(internvl_lora["config"]), str(pth), str(tmp_path / "hf")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds 1 weight(s) the config's InternVL_V1_5 does not have" in err, err
    assert "(first: model.mlp1.extra.weight)" in err and "config of its run" in err, err
    assert main([*args, "--save-format", "huggingface"]) == 2
    assert "--save-format huggingface is LLaVA's" in capsys.readouterr().err


def test_a_model_without_llm_other_than_internvl_is_refused(tmp_path, capsys):
    config = tmp_path / "other.py"
    config.write_text("model = dict(type='SomeVisionModel', path='x')\n")
    checkpoint = tmp_path / "iter_1.pth"
    checkpoint.write_bytes(b"")  # never read
    assert main(["convert", "pth_to_hf", str(config), str(checkpoint), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"the model of {config} (SomeVisionModel) has no model.llm" in err, err
    assert "xtuner-rope converts InternVL_V1_5 itself" in err, err
    assert not (tmp_path / "hf").exists()


def test_llava_lora_adapters_and_projector_saved_exactly(tmp_path):
    """The stock LLaVA QLoRA config without 4-bit (LoRA on the LLM and on CLIP): both adapters
    and the projector saved bit for bit, loaded by peft; the pieces give the module's logits."""
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForCausalLM, CLIPVisionModel
    from xtuner.model.utils import prepare_inputs_labels_for_multimodal
    from xtuner.registry import BUILDER

    from xtuner_rope.batch.images import IMAGE_TOKEN_INDEX
    from xtuner_rope.demo.llava_data import write_llava_data
    from xtuner_rope.demo.tiny_clip import save_tiny_clip

    sc.ensure_tiny_model()
    llm, clip = sc.tiny_with_remote_code(tmp_path / "llm"), save_tiny_clip(tmp_path / "clip")
    data = write_llava_data(tmp_path / "data", n_images=1, n_text=1)
    text = lc.localize_llava(sc.copy_stock(LLAVA_LORA, tmp_path), llm, clip, data)
    config = tmp_path / "lora.py"
    config.write_text(lc.enable_plugin_llava(text))
    cfg = Config.fromfile(config)
    cfg.model.llm.torch_dtype = torch.float32  # what the start-up loads on a CPU-only machine
    torch.manual_seed(0)
    model = BUILDER.build(cfg.model)
    _draw_lora_b(model)
    state = _save_as_runner(model, tmp_path / "iter_6.pth")
    model = model.float().eval()
    out = tmp_path / "hf"
    converted.convert(config, tmp_path / "iter_6.pth", out, "--dtype", "fp32")
    saved = converted.llava_saved_weights(out)
    assert any(k.startswith("visual_encoder.") and "lora_B" in k for k in saved)
    assert saved.keys() == state.keys(), sorted(saved.keys() ^ state.keys())[:5]
    assert not converted.unequal(saved, state)
    converted.convert(config, tmp_path / "iter_6.pth", tmp_path / "hf16", "--dtype", "bf16")
    assert not converted.unequal(
        converted.llava_saved_weights(tmp_path / "hf16"), state, cast=torch.bfloat16
    )

    base = AutoModelForCausalLM.from_pretrained(llm, trust_remote_code=True)
    plain_llm = PeftModel.from_pretrained(base, out / "llm_adapter").eval()
    plain_clip = PeftModel.from_pretrained(
        CLIPVisionModel.from_pretrained(clip), out / "visual_encoder_adapter"
    ).eval()
    projector = AutoModel.from_pretrained(out / "projector", trust_remote_code=True).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (1, 16), generator=g)
    ids[0, 1] = IMAGE_TOKEN_INDEX
    pixels = torch.randn(1, 3, 56, 56, generator=g)
    with torch.no_grad():
        trained = model({"input_ids": ids.clone(), "pixel_values": pixels}, mode="tensor").logits
        hidden = plain_clip(pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        data = prepare_inputs_labels_for_multimodal(
            llm=plain_llm, input_ids=ids, pixel_values=projector(hidden)
        )
        logits = plain_llm(**data).logits  # [1, s', V]
        with model.llm.disable_adapter(), model.visual_encoder.disable_adapter():
            without = model({"input_ids": ids.clone(), "pixel_values": pixels}, mode="tensor")
    torch.testing.assert_close(logits, trained, rtol=0, atol=1e-6)
    assert (without.logits - trained).abs().max() > 1e-2  # the adapters are in there
