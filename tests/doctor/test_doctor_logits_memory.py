"""The doctor's logits memory line: one row of ``max_length`` with the full and the chunked loss.

The byte counts are checked against the tensors the two losses really hold: every tensor with a
vocabulary-sized dimension that the model's own loss (transformers' ``ForCausalLMLoss`` on the
head's output) and the chunked loss (``ops.chunked_loss``) create, tracked live while they run
on the tiny InternLM2 (forward and backward), gives the peak the formula states.
"""

import weakref
from pathlib import Path

import pytest
import torch
from tiny_recipe import load_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.loss.loss_utils import ForCausalLMLoss

from xtuner_rope.demo.tiny import build_tiny_internlm2
from xtuner_rope.doctor.logits_memory import logits_memory, logits_memory_lines
from xtuner_rope.ops.chunked_loss import CHUNK_BYTES, chunked_causal_lm_loss

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_internlm2_short_dialogues.py"
VOCAB = 1000  # not 512, the row length: the tracker tells them apart by size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = build_tiny_internlm2(VOCAB, seed=0)
    folder = tmp_path_factory.mktemp("tiny-hf")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def figures(folder, plugin=True, **options):
    options = {"model.llm.pretrained_model_name_or_path": str(folder), **options}
    return logits_memory(load_config(str(TINY), options), 512, plugin)


class VocabPeak(TorchDispatchMode):
    """The peak bytes of the live storages of tensors with a dimension of ``vocab`` entries
    (the head's own weight left out)."""

    def __init__(self, vocab: int, weight: torch.Tensor):
        super().__init__()
        self.vocab, self.weight, self.live, self.peak = vocab, weight.data_ptr(), {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or self.vocab not in t.shape:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() != self.weight and id(storage) not in self.live:
                self.live[id(storage)] = storage.nbytes()
                weakref.finalize(storage, self.live.pop, id(storage), None)
                self.peak = max(self.peak, sum(self.live.values()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bytes_are_what_the_two_losses_hold(checkpoint, dtype):
    folder, model = checkpoint
    name = str(dtype).removeprefix("torch.")
    fig = figures(folder, chunked_loss=16, **{"model.llm.torch_dtype": name})
    hidden_size = model.config.hidden_size
    assert (fig["vocab"], fig["hidden"], fig["dtype"]) == (VOCAB, hidden_size, name)
    assert fig["full_because"] is None  # the tiny recipe trains on the chunked loss
    s, head = fig["tokens"], nn.Linear(hidden_size, VOCAB, bias=False).to(dtype)
    hidden = torch.randn(1, s, hidden_size, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, s))
    labels[:, : s // 2] = -100
    with VocabPeak(VOCAB, head.weight) as full:
        ForCausalLMLoss(head(hidden), labels, VOCAB).backward()
    # The formula counts s rows where the shifted logits hold s - 1.
    assert fig["full_bytes"] * (1 - 1 / s) <= full.peak <= fig["full_bytes"]
    head.weight.grad = hidden.grad = None
    with VocabPeak(VOCAB, head.weight) as chunked:
        chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=16).backward()
    assert fig["chunk_tokens"] == 16
    assert chunked.peak == fig["chunked_bytes"]
    # The fp32 gradient [V, H] with the chunk, or at the end with its copy in the dtype.
    copy = fig["head_grad_bytes"] // 4 * (0 if dtype == torch.float32 else 2)
    assert fig["chunked_bytes"] == fig["head_grad_bytes"] + max(fig["chunk_bytes"], copy)


def test_the_line_says_which_loss_runs_and_why(checkpoint):
    folder, _ = checkpoint
    line = logits_memory_lines(figures(folder))[0]
    assert line.startswith("logits       a row of 512 tokens x vocabulary 1000 (float32)")
    assert (
        CHUNK_BYTES // (4 * VOCAB) > 512  # the budget's chunk, cut to the row
        and "chunks of 512 tokens" in line
        and "this run trains on the chunked loss" in line
    )
    out = logits_memory_lines(figures(folder, chunked_loss=False))[0]
    assert out.endswith("keeps the full logits: the config opts out (chunked_loss = False)")
    assert "the plugin is not enabled" in logits_memory_lines(figures(folder, plugin=False))[0]
    dialogue = figures(folder, loss_normalization="dialogue")["full_because"]
    assert dialogue == 'loss_normalization = "dialogue" weighs dialogues from the full logits'


def test_bf16_and_lora_change_the_bytes(checkpoint):
    folder, model = checkpoint
    fig = figures(folder, **{"model.llm.torch_dtype": "torch.bfloat16", "model.lora": {"r": 8}})
    assert fig["dtype"] == "bfloat16"
    assert fig["full_bytes"] == 512 * VOCAB * 12
    assert fig["chunk_bytes"] == fig["chunk_tokens"] * VOCAB * (4 + 2)
    assert fig["head_grad_bytes"] == 0  # LoRA: the head's weight is frozen


def test_no_figures_without_a_length_or_a_readable_checkpoint(checkpoint, tmp_path):
    folder, _ = checkpoint
    cfg = load_config(str(TINY), {"model.llm.pretrained_model_name_or_path": str(folder)})
    assert logits_memory(cfg, None, True) is None
    missing = load_config(str(TINY), {"model.llm.pretrained_model_name_or_path": str(tmp_path)})
    assert logits_memory(missing, 512, True) is None
    assert logits_memory_lines(None) == []
