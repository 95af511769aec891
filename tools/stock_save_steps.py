"""Count XTuner's stock configs whose `save_steps` is not a multiple of `accumulative_counts`.

A checkpoint written between two optimizer steps holds no accumulated gradients (docs/distributed.md,
"Resume and accumulation windows"). This reads each config under `xtuner/configs` with `ast`
(nothing is imported or run): the top-level `save_steps`, `accumulative_counts` and
`sequence_parallel_size` assignments in file order, `accumulative_counts *= sequence_parallel_size`
included, as MMEngine would evaluate them. Configs with `save_steps <= 0` or without the two
names save no iteration checkpoints this way and are counted apart.

Usage:
    python tools/stock_save_steps.py [--list]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path

NAMES = ("save_steps", "accumulative_counts", "sequence_parallel_size")


def settings(path: Path) -> dict[str, int]:
    """The integer values of :data:`NAMES` after the config's top-level statements."""
    values: dict[str, int] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Name) and target.id in NAMES:
                try:
                    values[target.id] = int(ast.literal_eval(value))
                except (ValueError, TypeError):
                    values.pop(target.id, None)  # not a literal: unknown
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            name, right = node.target.id, node.value
            if name in values and isinstance(node.op, ast.Mult) and isinstance(right, ast.Name):
                if right.id in values:
                    values[name] *= values[right.id]
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print each misaligned config")
    args = parser.parse_args()
    root = Path(importlib.util.find_spec("xtuner").origin).parent / "configs"
    paths = sorted(p for p in root.rglob("*.py") if p.name != "__init__.py")
    saving, misaligned = [], []
    for path in paths:
        found = settings(path)
        save, accumulate = found.get("save_steps", 0), found.get("accumulative_counts")
        if save > 0 and accumulate:
            saving.append(path)
            if save % accumulate:
                misaligned.append(path)
                if args.list:
                    print(f"{path.relative_to(root)}: save_steps {save}, accumulation {accumulate}")
    print(
        f"{len(paths)} config files under {root}; {len(saving)} save every save_steps > 0 "
        f"iterations with a known accumulative_counts; in {len(misaligned)} of them save_steps "
        "is not a multiple of accumulative_counts"
    )


if __name__ == "__main__":
    main()
