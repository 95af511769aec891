"""XTuner's own parsers answered without importing XTuner: the tools' words, or no answer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xtuner_rope.outputs.xtuner_parsers import parser_answer, tool_script
from xtuner_rope.outputs.xtuner_tools import XTUNER_TOOLS
from xtuner_rope.outputs.xtuner_tools import parser_answer as tool_answer


def test_tool_script_is_the_file_python_would_run():
    for module in ("xtuner.tools.train", *XTUNER_TOOLS.values()):
        code = f"import importlib.util; print(importlib.util.find_spec({module!r}).origin)"
        found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert tool_script(module) == found.stdout.strip(), found.stderr[-2000:]
    with pytest.raises(ModuleNotFoundError, match="xtuner.tools.no_such_tool is not installed"):
        tool_script("xtuner.tools.no_such_tool")


def test_pth_to_hf_help_and_usage_error_are_its_own(capsys):
    assert tool_answer(("convert", "pth_to_hf"), ["-h"]) == 0
    assert "usage: xtuner convert pth_to_hf [-h]" in capsys.readouterr().out
    assert tool_answer(("convert", "pth_to_hf"), []) == 2
    assert "the following arguments are required: config, pth_model, save_dir" in (
        capsys.readouterr().err
    )
    assert tool_answer(("convert", "pth_to_hf"), ["c.py", "a.pth", "out"]) is None


def test_a_parser_that_needs_its_module_is_left_to_the_tool():
    # chat's choices come from XTuner's templates: it must run to answer, even for -h.
    assert tool_answer(("chat",), ["-h"]) is None


def test_a_file_without_parse_args_is_left_to_the_tool(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text("import torch\n\n\ndef main():\n    pass\n")
    assert parser_answer(str(script), ["-h"]) is None
