"""The tiny checkpoints: deterministic, offline, loadable through the Auto factories."""

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from xtuner._lite.modelings.internlm2 import InternLM2ForCausalLM

from xtuner_rope.config.startup import enable_xtuner_rope
from xtuner_rope.demo.resources import tiny_checkpoint
from xtuner_rope.demo.tiny import SPECIAL_TOKENS, save_tiny

REPO = Path(__file__).resolve().parents[2]
SAMPLE_DATA = REPO / "data" / "short_dialogues.jsonl"
# Plain transformers, in a process that never imports xtuner_rope: the checkpoint and its
# tokenizer load offline and run.
PLAIN_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {}
for path in sys.argv[1:]:
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out[path] = [type(model).__name__, len(tok), model.config.vocab_size,
                 model.config.num_hidden_layers, model.config.hidden_size,
                 bool(torch.isfinite(logits).all()), "xtuner_rope" in sys.modules]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "ckpt", dialogues_jsonl=SAMPLE_DATA)


def test_same_seed_same_files(tiny_dir, tmp_path):
    again = save_tiny(tmp_path / "again", dialogues_jsonl=SAMPLE_DATA)
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
    assert filecmp.cmp(
        tmp_path / "tiny" / "model.safetensors", tiny_dir / "model.safetensors", shallow=False
    )
    assert tiny_checkpoint(path, data_path="does-not-exist.jsonl") == path  # present: no rebuild


def test_local_checkpoint_explains_a_missing_path(tmp_path, tiny_dir):
    assert enable_xtuner_rope(str(tiny_dir), local_only=True) == str(tiny_dir)
    with pytest.raises(FileNotFoundError, match=r"no config.json there.*huggingface-cli download"):
        enable_xtuner_rope(str(tmp_path / "internlm2-chat-7b"), local_only=True)


def _tool(tmp_path: Path, script: str, *args: str) -> str:
    """Run ``tools/<script>`` from ``tmp_path``, far from the repository root."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / script), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_make_tiny_builds_every_family_from_any_directory(tmp_path, tiny_dir, monkeypatch):
    # The old command, run elsewhere, with the package's default data: the same checkpoint.
    assert "tiny internlm2 written to internlm2" in _tool(
        tmp_path, "make_tiny_internlm2.py", "--out", "internlm2"
    )
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert not filecmp.cmpfiles(tiny_dir, tmp_path / "internlm2", files, shallow=False)[1]
    assert "tiny mistral written to mistral" in _tool(
        tmp_path, "make_tiny.py", "--family", "mistral", "--out", "mistral"
    )
    monkeypatch.chdir(tmp_path)
    for family in ("llama", "qwen2"):
        save_tiny(family, family)
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, "llama", "qwen2", "mistral"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == {
        name: [cls, 1024, 1024, 2, 64, True, False]
        for name, cls in (
            ("llama", "LlamaForCausalLM"),
            ("qwen2", "Qwen2ForCausalLM"),
            ("mistral", "MistralForCausalLM"),
        )
    }
    with pytest.raises(
        ValueError,
        match=r"family 'gpt2' is not one of internlm2, llama, "
        r"qwen2, mistral",
    ):
        save_tiny(tmp_path / "gpt2", "gpt2")
