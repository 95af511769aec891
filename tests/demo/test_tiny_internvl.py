"""The tiny InternVL checkpoint loads as XTuner loads the hub's, with the hub's names."""

import json

import pytest
import torch

from xtuner_rope.demo.tiny import save_tiny
from xtuner_rope.demo.tiny_internvl import save_tiny_internvl, tokens_per_tile


def test_tiny_internvl_loads_with_remote_code_and_the_hub_names(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    out = save_tiny_internvl(save_tiny(tmp_path / "phi3", "phi3"), tmp_path / "internvl")
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_internvl_chat.InternVLChatModel"
    assert tokens_per_tile(config) == 16
    model = AutoModel.from_pretrained(out, trust_remote_code=True, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    context = tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert 0 <= context < model.language_model.get_input_embeddings().num_embeddings
    assert model.num_image_token == 16 and hasattr(model, "mlp1")
    tiles = torch.randn(3, 3, 112, 112)
    assert model.extract_feature(tiles).shape == (3, 16, model.language_model.config.hidden_size)


def test_an_llm_xtuner_cannot_template_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"architectures\[0\] = 'LlamaForCausalLM'; expected one of"
    ):
        save_tiny_internvl(save_tiny(tmp_path / "llama", "llama"), tmp_path / "internvl")
