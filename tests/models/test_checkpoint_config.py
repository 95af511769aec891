"""The one reader of a checkpoint's ``config.json`` (``models.checkpoint``), and that it is the one."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import xtuner_rope
from xtuner_rope.models.checkpoint import checkpoint_config, config_json_path

PACKAGE = Path(xtuner_rope.__file__).parent
READER = PACKAGE / "models" / "checkpoint.py"


def reads_config_json(source: str) -> bool:
    """A function that names ``config.json`` and parses JSON: a reader of it."""
    functions = [
        ast.get_source_segment(source, node) or ""
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    return any(
        '"config.json"' in body and re.search(r"\bjson\.loads?\(", body) for body in functions
    )


def test_reads_a_local_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 7}))
    config, data = checkpoint_config(str(tmp_path))
    assert config == tmp_path / "config.json" and data["vocab_size"] == 7


def test_no_config_json_is_none(tmp_path):
    assert checkpoint_config(str(tmp_path)) is None  # a directory without one
    assert checkpoint_config("org/not-downloaded") is None  # a hub id, local only
    assert config_json_path("org/never-downloaded-xtuner-rope", cached=True) is None  # offline
    assert checkpoint_config(None) is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_broken_config_json_is_named(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config\.json: .*re-download or fix it"):
        checkpoint_config(str(tmp_path))


def test_the_package_has_one_reader():
    readers = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != READER and reads_config_json(path.read_text(encoding="utf-8"))
    ]
    assert not readers, (
        "read a checkpoint's config.json with xtuner_rope.models.checkpoint.checkpoint_config"
    )
    # Negative control: what the start-up's own reader looked like before, found.
    assert reads_config_json(
        'def heads(path):\n    config = Path(path) / "config.json"\n'
        '    return json.loads(config.read_text())["num_attention_heads"]\n'
    )
