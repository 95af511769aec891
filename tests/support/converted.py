"""A DeepSpeed checkpoint read and converted, against the weights DeepSpeed saved (`convert` tests).

Imported as ``import converted`` (``tests/support`` is on ``sys.path``) by the tests that own a
real 2-process ZeRO run (tests/integration/test_resume.py), so no run is added for them.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch


def deepspeed_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """What DeepSpeed itself holds for ``iter_N.pth/``: the module of
    ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or, for ZeRO-3 (partitions only), DeepSpeed's own
    ``zero_to_fp32`` gather of the fp32 partitions; names without ``module.``."""
    states = checkpoint / "mp_rank_00_model_states.pt"
    if states.is_file():
        state = torch.load(states, map_location="cpu", weights_only=False)["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), checkpoint.name)
    return {k.removeprefix("module."): v for k, v in state.items()}


def read_as_xtuner(checkpoint: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """XTuner's ``guess_load_checkpoint`` of the folder (``dtype``: its reader with that dtype,
    e.g. ``torch.float16``, the default of xtuner 0.2.0 without the plugin's patch)."""
    if dtype is None:
        from xtuner.model.utils import guess_load_checkpoint

        return guess_load_checkpoint(str(checkpoint))
    from xtuner.utils.zero_to_any_dtype import get_state_dict_from_zero_checkpoint

    return get_state_dict_from_zero_checkpoint(str(checkpoint.parent), checkpoint.name, dtype=dtype)


def unequal(read: dict, reference: dict, cast=None) -> list[str]:
    """The names of ``read`` whose tensor is not ``reference``'s (cast to ``cast``) bit for bit."""
    return [
        name
        for name, tensor in read.items()
        if not torch.equal(tensor, reference[name] if cast is None else reference[name].to(cast))
    ]


def convert(config: Path, checkpoint: Path, out: Path, *options: str) -> str:
    """``xtuner-rope convert pth_to_hf CONFIG CHECKPOINT OUT [options]`` in this process; what it
    printed (it must succeed)."""
    from xtuner_rope.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["convert", "pth_to_hf", str(config), str(checkpoint), str(out), *options])
    assert status == 0, printed.getvalue()[-3000:]
    return printed.getvalue()


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights ``save_pretrained`` wrote (a model's or an adapter's), renamed as XTuner's
    model names them: ``llm.`` first; an adapter's ``lora_A.weight`` as ``lora_A.default.weight``."""
    for name in ("pytorch_model.bin", "adapter_model.bin"):
        if (folder / name).is_file():
            state = torch.load(folder / name, map_location="cpu", weights_only=True)
            break
    else:
        from safetensors.torch import load_file

        (path,) = folder.glob("*.safetensors")
        state = load_file(path)
    adapter = (folder / "adapter_config.json").is_file()
    return {
        "llm." + (k.replace(".weight", ".default.weight") if adapter else k): v
        for k, v in state.items()
    }


def merged_against_module(
    config: Path, adapter: Path, state: dict[str, torch.Tensor], out: Path
) -> dict[str, float]:
    """``xtuner-rope convert merge BASE ADAPTER OUT --dtype fp32`` in this process (``BASE``: the
    config's LLM, ``ADAPTER``: a LoRA checkpoint converted by ``pth_to_hf``), loaded by plain
    transformers, against the config's model with the checkpoint's weights ``state`` (the module
    with its adapter, evaluation mode) on a probe of 64 token ids ``[1, 64]``: the largest
    weight difference from peft's fp32 merge of that module, the largest logit difference, the
    largest logit and how far the adapter moves the logits (the module without it)."""
    from mmengine.config import Config
    from transformers import AutoModelForCausalLM
    from xtuner.registry import BUILDER

    from xtuner_rope.cli import main

    cfg = Config.fromfile(config)
    base = Path(cfg.model.llm.pretrained_model_name_or_path)
    base = base if base.is_absolute() else Path(__file__).resolve().parents[2] / base
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["convert", "merge", str(base), str(adapter), str(out), "--dtype", "fp32"])
    assert status == 0 and "merged and saved in fp32 (asked)" in printed.getvalue(), printed
    model = BUILDER.build(cfg.model).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not set(state) & set(missing), unexpected
    merged = AutoModelForCausalLM.from_pretrained(
        out, torch_dtype=torch.float32, trust_remote_code=True
    ).eval()
    ids = torch.arange(64)[None] % merged.config.vocab_size + 1  # [1, 64]
    with torch.no_grad():
        trained = model.llm(input_ids=ids).logits  # [1, 64, V]
        with model.llm.disable_adapter():
            without = model.llm(input_ids=ids).logits
        logits = merged(input_ids=ids).logits
        by_peft = model.llm.merge_and_unload().state_dict()  # the module's adapter merged
    weights = merged.state_dict()
    assert weights.keys() == by_peft.keys(), sorted(weights.keys() ^ by_peft.keys())[:5]
    return {
        "weights": max((weights[k] - by_peft[k]).abs().max().item() for k in weights),
        "logits": (logits - trained).abs().max().item(),
        "largest": trained.abs().max().item(),
        "adapter": (without - trained).abs().max().item(),
    }


def llava_saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    """What XTuner's ``LLaVAModel.to_hf`` (format ``xtuner``) saved under ``folder``, named as
    the model's ``state_dict``: the LLM (``folder`` itself, full fine-tune) or its adapter
    (``llm_adapter/``) as ``llm.``, ``projector/`` as ``projector.``, ``visual_encoder/`` (or
    its adapter, ``visual_encoder_adapter/``) as ``visual_encoder.``."""
    weights = {}
    if any(folder.glob("*.safetensors")) or (folder / "pytorch_model.bin").is_file():
        weights.update(saved_weights(folder))
    if (folder / "llm_adapter").is_dir():
        weights.update(saved_weights(folder / "llm_adapter"))
    for part, folder_name in (
        ("projector", "projector"),
        ("visual_encoder", "visual_encoder"),
        ("visual_encoder", "visual_encoder_adapter"),
    ):
        if (folder / folder_name).is_dir():
            saved = saved_weights(folder / folder_name).items()
            weights.update({f"{part}.{k.removeprefix('llm.')}": v for k, v in saved})
    return weights
