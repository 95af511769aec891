"""The embedded tiny InternLM2: deterministic, offline, loadable through the Auto factories."""

import filecmp
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from xtuner._lite.modelings.internlm2 import InternLM2ForCausalLM

from xtuner_rope.demo.resources import tiny_checkpoint
from xtuner_rope.demo.tiny import SPECIAL_TOKENS, save_tiny_internlm2
from xtuner_rope.startup import enable_xtuner_rope

SAMPLE_DATA = Path(__file__).resolve().parents[1] / "data" / "short_dialogues.jsonl"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_internlm2(tmp_path_factory.mktemp("tiny") / "ckpt", SAMPLE_DATA)


def test_same_seed_same_files(tiny_dir, tmp_path):
    again = save_tiny_internlm2(tmp_path / "again", SAMPLE_DATA)
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    match, mismatch, errors = filecmp.cmpfiles(tiny_dir, again, files, shallow=False)
    assert not mismatch and not errors


def test_loads_offline_through_auto_classes_as_xtuners_internlm2(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model) is InternLM2ForCausalLM
    assert "auto_map" not in (tiny_dir / "config.json").read_text()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tokenizer) == model.config.vocab_size
    ids = tokenizer("<|im_start|>user\nHello!<|im_end|>", add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(ids) == "<|im_start|>user\nHello!<|im_end|>"
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS[:3]] == [0, 1, 2]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer)) and torch.isfinite(logits).all()


def test_model_resource_builds_when_missing(tmp_path, tiny_dir):
    path = str(tmp_path / "tiny")
    assert tiny_checkpoint(path, data_path=str(SAMPLE_DATA)) == path
    assert filecmp.cmp(tmp_path / "tiny" / "model.safetensors", tiny_dir / "model.safetensors",
                       shallow=False)
    assert tiny_checkpoint(path, data_path="does-not-exist.jsonl") == path  # present: no rebuild


def test_local_checkpoint_explains_a_missing_path(tmp_path, tiny_dir):
    assert enable_xtuner_rope(str(tiny_dir), local_only=True) == str(tiny_dir)
    with pytest.raises(FileNotFoundError, match=r"no config.json there.*huggingface-cli download"):
        enable_xtuner_rope(str(tmp_path / "internlm2-chat-7b"), local_only=True)
