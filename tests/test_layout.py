"""The package's layout is its architecture: imports run downward only, no private imports.

Floors, lowest first (a module may import its own folder and any lower floor, nothing else):

    0 ops/      family-free math, torch only (importing it patches nothing)
    1 batch/    what the collate function and the batch hooks share
    2 models/   one file per family, the family dispatch (models.dispatch)
    3 checkpoints/  crash-safe checkpoints: loaded weights-only, written whole, resumed complete
    4 compat/   every patch of a third-party gap (the one place that patches)
    5 data/     collate functions, lossless pack step    | same floor: neither imports
    5 config/   the start-up, its findings, the re-check | the other
    6 hooks/    the MMEngine hooks (isolation, monitor, loss)         | same floor: neither
    6 evaluation/  the held-out metrics and their hook                 | imports the other
    7 demo/     tiny checkpoints, sample data, run-log checks
    8 doctor/   the dataset doctor (``xtuner-rope doctor``)   | same floor: neither imports
    8 outputs/  xtuner-rope train, replay of a recorded batch, XTuner's tools  | the other
    9 capture/  the captures of real runs, the packed-against-alone measurements
   10 check/    ``xtuner-rope check``: runner, report, one module per kind, ``KINDS``
   11 cli, __init__ (the public API)

The maintainer's tools (the config zoo ``tools/zoo/``, the sample-data generator
``tools/sample_data/``) live outside the package and the wheel: the package never imports
``tools`` (nor ``tests``); they import the package.

Every import inside the package, at module level or inside a function, is read from the
source with ``ast``, and none may close a circle (not even inside one folder: a function-level
import back is a circle all the same). Importing ``xtuner_rope.ops`` must leave MMEngine,
transformers and XTuner unimported (checked in a fresh interpreter). No module reads the
interpreter's frames to decide what to do, but ``compat.xtuner_model_resource.config_being_started``
(xtuner 0.2.0 ``xtuner train`` hands its config to no one).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import xtuner_rope

PACKAGE = Path(xtuner_rope.__file__).parent
FLOORS = {
    "ops": 0,
    "batch": 1,
    "models": 2,
    "checkpoints": 3,
    "compat": 4,
    "data": 5,
    "config": 5,
    "hooks": 6,
    "evaluation": 6,
    "demo": 7,
    "doctor": 8,
    "outputs": 8,
    "capture": 9,
    "check": 10,
}
TOP = 11  # the top-level modules: cli, __init__
OPS_MAY_IMPORT = {
    "torch",
    "numpy",
    "flash_attn",
    "triton",
}  # kernels; besides the stdlib and ops itself


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder(module: str) -> str:
    """The role folder of ``module`` (``"hooks"``), or ``""`` for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS) else ""


def layer(module: str) -> int:
    return FLOORS.get(folder(module), TOP)


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
# The maintainer's tools that left the package (issue 59) keep its rule of a docstring a module.
TOOLS = PACKAGE.parent / "tools"
TOOL_SOURCES = sorted([*(TOOLS / "zoo").glob("*.py"), *(TOOLS / "sample_data").glob("*.py")])


def edges():
    for path in SOURCES:
        src = module_name(path)
        for line, base, names in imports(path):
            targets = [resolve(base, n) for n in names] or [base]
            for target, name in zip(targets, names or [""]):
                yield path, line, src, target, name


def test_the_package_has_the_role_folders():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(FLOORS)
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == {"__init__", "cli"}, (
        "a new top-level module: put it in the role folder it belongs to (see the floors above)"
    )


@pytest.mark.parametrize(
    "path", SOURCES + TOOL_SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent))
)
def test_every_module_says_what_it_is(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip().splitlines()[0].strip(), f"{path}: no one-line docstring"
    assert "TODO" not in doc


def test_imports_run_downward_only():
    upward = [
        f"{p.relative_to(PACKAGE)}:{line}: {src} (floor {layer(src)}) imports {target} "
        f"(floor {layer(target)})"
        for p, line, src, target, _ in edges()
        if target.split(".")[0] == "xtuner_rope" and layer(target) > layer(src)
    ]
    assert not upward, "\n".join(upward)


def test_folders_on_one_floor_do_not_import_each_other():
    across = [
        f"{p.relative_to(PACKAGE)}:{line}: {src} imports {target}"
        for p, line, src, target, _ in edges()
        if target.split(".")[0] == "xtuner_rope"
        and folder(src)
        and folder(target)
        and folder(src) != folder(target)
        and layer(src) == layer(target) < TOP
    ]
    assert not across, "\n".join(across)


def test_every_import_of_the_package_resolves():
    """A relative import that a move left pointing at nothing fails here, not at run time."""

    def exists(module: str) -> bool:
        path = PACKAGE.parent / Path(*module.split("."))
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()

    broken = [
        f"{p.relative_to(PACKAGE)}:{line}: {target}"
        for p, line, _, target, _ in edges()
        if target.split(".")[0] == "xtuner_rope" and not exists(target)
    ]
    assert not broken, "\n".join(broken)


# The one reader of the interpreter's frames, and why: xtuner 0.2.0 ``xtuner train`` calls
# ``set_model_resource(cfg)`` -> ``fn(path)`` through a name bound before any plugin code ran.
FRAME_READER = ("compat/xtuner_model_resource.py", "config_being_started")
FRAME_CALLS = ("sys._getframe", "inspect.currentframe", "inspect.stack", ".f_back", ".f_locals")


def test_one_documented_function_reads_the_interpreters_frames():
    files = {
        str(path.relative_to(PACKAGE))
        for path in SOURCES
        if any(call in path.read_text() for call in FRAME_CALLS)
    }
    assert files == {FRAME_READER[0]}, f"frames read outside {FRAME_READER}: {sorted(files)}"
    source = (PACKAGE / FRAME_READER[0]).read_text()
    functions = {
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
        and any(call in ast.get_source_segment(source, node) for call in FRAME_CALLS)
    }
    assert functions == {FRAME_READER[1]}, functions
    module = importlib.import_module("xtuner_rope.compat.xtuner_model_resource")
    assert "frame" in getattr(module, FRAME_READER[1]).__doc__  # it says why


def test_the_package_imports_no_maintainer_tool_and_no_test():
    """``tools/`` and ``tests/`` are not in the wheel: an import of them from the package would
    work in a checkout and fail for every user who installed it."""
    outside = [
        f"{p.relative_to(PACKAGE)}:{line}: {target}"
        for p, line, _, target, _ in edges()
        if target.split(".")[0] in {"tools", "tests"}
    ]
    assert not outside, "\n".join(outside)


def test_importing_ops_patches_nothing():
    code = (
        "import sys, xtuner_rope.ops.packing, xtuner_rope.ops.attention, xtuner_rope.ops.rope\n"
        "loaded = [m for m in ('mmengine', 'transformers', 'xtuner', 'deepspeed', "
        "'xtuner_rope.compat') if m in sys.modules]\n"
        "assert not loaded, loaded"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_ops_imports_torch_and_the_standard_library_only():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = [
        f"{p.relative_to(PACKAGE)}:{line}: {target}"
        for p, line, src, target, _ in edges()
        if layer(src) == 0
        and target.split(".")[0] not in stdlib | OPS_MAY_IMPORT
        and not target.startswith("xtuner_rope.ops")
    ]
    assert not bad, "\n".join(bad)


def test_no_private_name_is_imported_from_another_module():
    private = [
        f"{p.relative_to(PACKAGE)}:{line}: {name} from {target}"
        for p, line, src, target, name in edges()
        if target.split(".")[0] == "xtuner_rope"
        and target != src
        and name.startswith("_")
        and not name.startswith("__")
    ]
    assert not private, "\n".join(private)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside a function."""
    graph: dict[str, set[str]] = {module_name(p): set() for p in SOURCES}
    for _, _, src, target, _ in edges():
        if target in graph and target != src:
            graph[src].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return trail[trail.index(nxt) :] + [node, nxt] if nxt in trail else [node, nxt]
            if nxt not in state:
                found = visit(nxt, trail + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_imports_have_no_cycle():
    """Function-level imports count: a circle deferred into a function is still a circle (the
    check dispatcher importing its kinds, which import it back, was one)."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_function_level_import_back_is_a_cycle():
    """Negative control: the circle this test exists for (check.py <-> check_preference.py,
    the second direction inside a function) is found."""
    graph = {
        "xtuner_rope.check.kinds": {"xtuner_rope.check.preference"},
        "xtuner_rope.check.preference": {"xtuner_rope.check.runner"},
        "xtuner_rope.check.runner": {"xtuner_rope.check.kinds"},  # e.g. inside a function
    }
    assert find_cycle(graph) == [
        "xtuner_rope.check.kinds",
        "xtuner_rope.check.preference",
        "xtuner_rope.check.runner",
        "xtuner_rope.check.kinds",
    ]
    graph["xtuner_rope.check.runner"] = set()
    assert find_cycle(graph) is None
