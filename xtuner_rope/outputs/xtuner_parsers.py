"""XTuner's own command-line parsers, answered without importing XTuner (help, usage errors).

XTuner's tools (``xtuner/tools/train.py``, ``model_converters/pth_to_hf.py``, ...) import torch,
MMEngine and XTuner (seconds) before their ``parse_args()`` runs, so ``-h`` or a misspelled flag
waits for them. :func:`parser_answer` reads ``parse_args`` from the very file the tool would
run and calls it with argparse alone (MMEngine's ``DictAction`` stood in for by
:class:`AnyValues`): what it prints and its exit status are the tool's own. A ``parse_args``
that needs more of its module (``chat``'s template names, ``merge``'s device query) is left to
the tool: the answer is then ``None``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path


class AnyValues(argparse.Action):
    """Stands in for MMEngine's ``DictAction``: keeps the values as text.

    Only argparse's own verdict is wanted here; the values are parsed by the tool itself, by the
    real ``DictAction`` (whose import would cost torch's).
    """

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


def tool_script(module: str) -> str:
    """Path of ``module``'s file (e.g. ``xtuner.tools.train``), found without importing it.

    ``importlib.util.find_spec("xtuner.tools.train")`` would import ``xtuner`` (and with it
    MMEngine and torch, 3 s): the file is looked up in the top-level package's folders instead.

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
    """What ``script`` 's ``parse_args()`` answers by itself to ``argv``: help, or a usage error.

    Args:
        script: The tool's file (:func:`tool_script`).
        argv: Its arguments.
        prog: ``sys.argv[0]`` as the tool would see it (default: ``script``; argparse shows its
            base name in the usage line).

    Returns:
        The exit status when ``parse_args`` stopped (0 after the help, 2 on a usage error),
        having printed what it prints; ``None`` when the arguments parse, or when the file has
        no self-contained ``parse_args`` (the tool then decides, as it always did).
    """
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
