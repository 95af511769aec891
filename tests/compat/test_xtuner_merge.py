"""`xtuner_merge.merge_loading_in`: `xtuner convert merge`'s fp16 base load replaced by the dtype asked.

The merge itself, against the trained LoRA model, is in tests/outputs/test_xtuner_tools.py.
"""

from __future__ import annotations

import stock_configs as sc
import torch
from transformers import AutoModelForCausalLM

import xtuner_rope  # noqa: F401  (registers InternLM2 with the Auto classes)
from xtuner_rope.compat.xtuner_merge import merge_loading_in


def test_the_load_gets_the_dtype_asked_and_is_restored_after():
    tiny = sc.ensure_tiny_model()
    before = vars(AutoModelForCausalLM).get("from_pretrained")
    with merge_loading_in(torch.bfloat16) as redirected:
        assert redirected
        model = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float16)  # merge.py
    assert model.dtype == torch.bfloat16
    assert vars(AutoModelForCausalLM).get("from_pretrained") is before  # restored
    plain = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float16)
    assert plain.dtype == torch.float16


def test_a_clip_base_gets_the_dtype_asked_too(tmp_path):
    """merge.py's ``--is-clip`` loads ``CLIPVisionModel.from_pretrained`` with no dtype (fp32):
    under ``--dtype bf16`` it said "saved in bf16" and saved fp32 before."""
    from transformers import CLIPVisionModel

    from xtuner_rope.demo.tiny_clip import save_tiny_clip

    clip = save_tiny_clip(tmp_path / "clip")
    with merge_loading_in(torch.bfloat16) as redirected:
        assert redirected
        model = CLIPVisionModel.from_pretrained(clip)  # as merge.py --is-clip calls it
    assert model.dtype == torch.bfloat16
    assert "from_pretrained" not in vars(CLIPVisionModel)  # the inherited method is back
    assert CLIPVisionModel.from_pretrained(clip).dtype == torch.float32
