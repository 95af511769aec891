"""XTuner's own command-line parsers, answered without importing XTuner (help, usage errors).

:func:`parser_answer` runs ``parse_args`` of the very file the tool would run with argparse
alone; one that needs more of its module is left to the tool (``None``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path


class AnyValues(argparse.Action):
    """Stands in for MMEngine's ``DictAction`` (whose import costs torch's): keeps the values as
    text."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


def tool_script(module: str) -> str:
    """Path of ``module``'s file (e.g. ``xtuner.tools.train``), found without importing ``xtuner``.

    Raises:
        ModuleNotFoundError: no such file (XTuner not installed).
    """
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    relative = Path(*rest).with_suffix(".py")
    for folder in folders:
        if (Path(folder) / relative).is_file():
            return str(Path(folder) / relative)
    raise ModuleNotFoundError(f"{module} is not installed (pip install xtuner)")


def parser_answer(script: str, argv: list[str], prog: str | None = None) -> int | None:
    """What ``script`` 's ``parse_args()`` answers by itself to ``argv`` (``sys.argv[0]``
    ``prog``): 0 after the help, 2 on a usage error; None when the arguments parse or the file
    has no self-contained ``parse_args``."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"), filename=script)
        (function,) = [
            node
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name == "parse_args"
        ]
        namespace = {"argparse": argparse, "DictAction": AnyValues}
        exec(compile(ast.Module(body=[function], type_ignores=[]), script, "exec"), namespace)
    except (OSError, SyntaxError, ValueError):
        return None
    saved, sys.argv = sys.argv, [prog or script, *argv]
    try:
        namespace["parse_args"]()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except Exception:  # it needs a name of its module (NameError...): leave it to the tool
        return None
    finally:
        sys.argv = saved
    return None


__all__ = ["AnyValues", "parser_answer", "tool_script"]
