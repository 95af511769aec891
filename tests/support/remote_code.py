"""A tiny checkpoint of a family xtuner-rope does not serve, with its own modeling code.

What a user of Baichuan2, MiniCPM3, ChatGLM3, InternLM 1, Qwen 1 or DeepSeek-MoE has: a
checkpoint directory whose ``config.json`` ``auto_map`` sends transformers' Auto classes to a
``modeling_*.py`` shipped inside it (``trust_remote_code=True``). Here the family is a small real
``PreTrainedModel`` (RoPE, one causal attention layer) named ``remote_llm``; its module prints
``MODELING_IMPORTED`` when transformers imports it, so a run can show that the remote code (and
so the weights) never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_TYPE = "remote_llm"
MODELING_IMPORTED = "remote_llm: modeling code imported"
MODELING = '''"""A tiny RoPE language model shipped as a checkpoint's remote code (tests only)."""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

print("{marker}", flush=True)


class RemoteLLMConfig(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, vocab_size=1024, hidden_size=32, num_heads=2, rope_theta=10000.0, **kw):
        self.vocab_size, self.hidden_size, self.num_heads = vocab_size, hidden_size, num_heads
        self.rope_theta = rope_theta
        super().__init__(**kw)


def _rotate(x, theta):
    # x: [b, n_h, s, h_d]; half-split RoPE on positions 0..s-1
    h_d, s = x.shape[-1], x.shape[-2]
    inv = theta ** (-torch.arange(0, h_d, 2, dtype=torch.float32) / h_d)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)  # [s, h_d / 2]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # [s, h_d]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RemoteLLMForCausalLM(PreTrainedModel):
    config_class = RemoteLLMConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, labels=None, **kwargs):
        b, s = input_ids.shape
        n_h = self.config.num_heads
        h = self.embed(input_ids)  # [b, s, hidden]
        q, k, v = self.qkv(h).view(b, s, 3, n_h, -1).permute(2, 0, 3, 1, 4)  # 3 x [b, n_h, s, h_d]
        q, k = _rotate(q, self.config.rope_theta), _rotate(k, self.config.rope_theta)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.out(h + a.transpose(1, 2).reshape(b, s, -1))  # [b, s, vocab]
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)
'''


def save_remote_code_checkpoint(path: Path, tokenizer_from: Path) -> Path:
    """Write the checkpoint (modeling file, ``config.json`` with ``auto_map``, weights, the
    tokenizer of ``tokenizer_from``) into ``path``, as ``save_pretrained`` of remote code does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path.mkdir(parents=True)
    (path / "modeling_remote_llm.py").write_text(
        MODELING.format(marker=MODELING_IMPORTED, model_type=MODEL_TYPE)
    )
    auto_map = {
        "AutoConfig": "modeling_remote_llm.RemoteLLMConfig",
        "AutoModelForCausalLM": "modeling_remote_llm.RemoteLLMForCausalLM",
    }
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": MODEL_TYPE,
                "architectures": ["RemoteLLMForCausalLM"],
                "auto_map": auto_map,
                "vocab_size": 1024,
            }
        )
    )
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_from), trust_remote_code=True).save_pretrained(
        str(path)
    )
    assert json.loads((path / "config.json").read_text())["auto_map"] == auto_map
    return path
