"""Converted LLaVA / InternVL folders loaded as a user without the plugin loads them; logits.

Run as a fresh process (``python tests/support/multimodal_plain.py KIND ...``) by
tests/integration/test_convert_multimodal.py; it never imports xtuner_rope (checked at the end):

- ``llava FOLDER LLM CLIP INPUTS OUT``: ``pth_to_hf``'s LLaVA LoRA folder: the base LLM with
  ``llm_adapter/`` and the base CLIP with ``visual_encoder_adapter/`` (peft), ``projector/``
  (``AutoModel``, its remote code);
- ``llava-merged LLM CLIP PROJECTOR INPUTS OUT``: merged LLM and CLIP folders (``convert merge``)
  and a projector, transformers only;
- ``internvl FOLDER INPUTS OUT``: an InternVL folder through ``AutoModel`` (remote code).

``INPUTS`` holds ``input_ids`` ``[1, s]`` and ``pixel_values``; ``OUT`` gets the logits, the
loaded weights (``state``) and transformers' loading info. LLaVA's image expansion is XTuner's
``prepare_inputs_labels_for_multimodal`` (what XTuner's chat runs), the visual layer -2 (the stock
``visual_select_layer``).
"""

from __future__ import annotations

import sys
import types

import torch


def _peft_importable() -> None:
    """bitsandbytes 0.45 (pinned by xtuner 0.2.0) imports ``triton.ops``, which triton >= 3.2
    lacks, and takes peft with it: any peft user on this stack answers bitsandbytes' triton
    probe False (what ``xtuner_rope.compat`` does; this is not the plugin)."""
    probe = types.ModuleType("bitsandbytes.triton.triton_utils")
    probe.is_triton_available = lambda: False
    sys.modules[probe.__name__] = probe


def _llava_logits(llm, clip, projector, data: dict) -> torch.Tensor:
    from xtuner.model.utils import prepare_inputs_labels_for_multimodal

    with torch.no_grad():
        hidden = clip(data["pixel_values"], output_hidden_states=True).hidden_states[-2][:, 1:]
        mm = prepare_inputs_labels_for_multimodal(
            llm=llm, input_ids=data["input_ids"], pixel_values=projector(hidden)
        )
        return llm(**mm).logits  # [1, s', V]


def llava(folder: str, llm_path: str, clip_path: str, data: dict) -> dict:
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForCausalLM, CLIPVisionModel

    fp32 = dict(torch_dtype=torch.float32)
    llm = AutoModelForCausalLM.from_pretrained(llm_path, trust_remote_code=True, **fp32)
    llm = PeftModel.from_pretrained(llm, f"{folder}/llm_adapter").eval()
    clip = CLIPVisionModel.from_pretrained(clip_path, **fp32)
    clip = PeftModel.from_pretrained(clip, f"{folder}/visual_encoder_adapter").eval()
    projector = AutoModel.from_pretrained(f"{folder}/projector", trust_remote_code=True, **fp32)
    return {"logits": _llava_logits(llm, clip, projector.eval(), data)}


def llava_merged(llm_path: str, clip_path: str, projector_path: str, data: dict) -> dict:
    from transformers import AutoModel, AutoModelForCausalLM, CLIPVisionModel

    fp32 = dict(torch_dtype=torch.float32)
    llm = AutoModelForCausalLM.from_pretrained(llm_path, trust_remote_code=True, **fp32).eval()
    clip = CLIPVisionModel.from_pretrained(clip_path, **fp32).eval()
    projector = AutoModel.from_pretrained(projector_path, trust_remote_code=True, **fp32).eval()
    return {"logits": _llava_logits(llm, clip, projector, data)}


def internvl(folder: str, data: dict) -> dict:
    from transformers import AutoModel, AutoTokenizer

    model, info = AutoModel.from_pretrained(
        folder, trust_remote_code=True, torch_dtype=torch.float32, output_loading_info=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model.img_context_token_id = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    tiles = torch.ones(data["pixel_values"].shape[0], dtype=torch.long)
    with torch.no_grad():
        logits = model.eval()(
            pixel_values=data["pixel_values"], input_ids=data["input_ids"], image_flags=tiles
        ).logits
    info = {k: sorted(v) for k, v in info.items() if k != "error_msgs"}
    return {"logits": logits, "state": model.state_dict(), "info": info}


def main(argv: list[str]) -> None:
    kind, *args, inputs, out = argv
    data = torch.load(inputs)
    _peft_importable()
    result = {"llava": llava, "llava-merged": llava_merged, "internvl": internvl}[kind](*args, data)
    torch.save(result, out)
    assert not any(name.startswith("xtuner_rope") for name in sys.modules)
    print("PLAIN_OK")


if __name__ == "__main__":
    main(sys.argv[1:])
