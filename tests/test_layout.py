"""The package's layout is its architecture: imports run downward only, no private imports.

Layers, lowest first: ``ops/`` (torch-only math) <- ``batch/`` <- ``models/`` <- the face (the
top-level modules users name in configs) <- the tools on top (``cli``, ``doctor/``, ``demo/``,
the deprecated ``resources``). Every import inside the package, at module level or inside a
function, is read from the source with ``ast``.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import xtuner_rope

PACKAGE = Path(xtuner_rope.__file__).parent
TOP = {"cli", "resources"}  # top-level modules that sit above the face
LAYERS = {"ops": 0, "batch": 1, "models": 2, "doctor": 4, "demo": 4}
FACE = 3
OPS_MAY_IMPORT = {"torch", "numpy", "flash_attn"}  # kernels; besides the stdlib and ops itself


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the package itself: __init__ re-exports the face
        return FACE
    if parts[1] in LAYERS:
        return LAYERS[parts[1]]
    return 4 if parts[1] in TOP else FACE


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of every import statement in ``path``."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base, [a.name for a in node.names]))
    return found


def resolve(base: str, name: str) -> str:
    """``from base import name``: the module meant, when ``name`` is a submodule."""
    candidate = f"{base}.{name}"
    path = PACKAGE.parent / Path(*candidate.split("."))
    return candidate if path.with_suffix(".py").exists() or path.is_dir() else base


SOURCES = sorted(PACKAGE.rglob("*.py"))


def edges():
    for path in SOURCES:
        src = module_name(path)
        for line, base, names in imports(path):
            targets = [resolve(base, n) for n in names] or [base]
            for target, name in zip(targets, names or [""]):
                yield path, line, src, target, name


def test_the_package_has_the_role_folders():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == {"ops", "batch", "models", "doctor", "demo"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_says_what_it_is(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip().splitlines()[0].strip(), f"{path}: no one-line docstring"
    assert "TODO" not in doc


def test_imports_run_downward_only():
    upward = [f"{p.relative_to(PACKAGE)}:{line}: {src} (layer {layer(src)}) imports {target} "
              f"(layer {layer(target)})"
              for p, line, src, target, _ in edges()
              if target.split(".")[0] == "xtuner_rope" and layer(target) > layer(src)]
    assert not upward, "\n".join(upward)


def test_ops_imports_torch_and_the_standard_library_only():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = [f"{p.relative_to(PACKAGE)}:{line}: {target}" for p, line, src, target, _ in edges()
           if layer(src) == 0 and target.split(".")[0] not in stdlib | OPS_MAY_IMPORT
           and not target.startswith("xtuner_rope.ops")]
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_from_another_module():
    private = [f"{p.relative_to(PACKAGE)}:{line}: {name} from {target}"
               for p, line, src, target, name in edges()
               if target.split(".")[0] == "xtuner_rope" and target != src
               and name.startswith("_") and not name.startswith("__")]
    assert not private, "\n".join(private)


def test_module_level_imports_have_no_cycle():
    graph: dict[str, set[str]] = {module_name(p): set() for p in SOURCES}
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        src = module_name(path)
        for line, base, names in imports(path):
            node_is_top = any(getattr(n, "lineno", None) == line and id(n) in top_level
                              for n in tree.body)
            if not node_is_top:
                continue
            for target in [resolve(base, n) for n in names] or [base]:
                if target in graph and target != src:
                    graph[src].add(target)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])
