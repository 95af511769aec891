"""The one reader of a checkpoint's ``config.json`` (``models.checkpoint_config``), and that it is
the one (its cases of hub ids, offline mode and the findings on top: ``tests/config/
test_checkpoint_findings.py``)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import xtuner_rope
from xtuner_rope.models.checkpoint_config import read_checkpoint_config

PACKAGE = Path(xtuner_rope.__file__).parent
READER = PACKAGE / "models" / "checkpoint_config.py"


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
    config = read_checkpoint_config(str(tmp_path))
    assert config.source == str(tmp_path / "config.json") and config.get("vocab_size") == 7


def test_no_config_json_is_named(tmp_path):
    assert "has no config.json" in read_checkpoint_config(str(tmp_path)).problem
    assert read_checkpoint_config(None) is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_broken_config_json_is_named(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    config = read_checkpoint_config(str(tmp_path))
    assert config.data is None and re.search(
        r"config\.json (is not valid JSON|holds no JSON)", config.problem
    )


def test_the_package_has_one_reader():
    readers = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != READER and reads_config_json(path.read_text(encoding="utf-8"))
    ]
    assert not readers, (
        "read a checkpoint's config.json with xtuner_rope.models.checkpoint_config.read_checkpoint_config"
    )
    # Negative control: what the start-up's own reader looked like before, found.
    assert reads_config_json(
        'def heads(path):\n    config = Path(path) / "config.json"\n'
        '    return json.loads(config.read_text())["num_attention_heads"]\n'
    )
