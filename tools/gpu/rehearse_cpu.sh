#!/usr/bin/env bash
# Rehearse tools/gpu/run_gpu.sh on this CPU machine, offline, as the GPU machine would run it:
# the kit is installed with no index into a fresh folder and sees only an emulated image (the
# distributions of tools/gpu/image_modules.txt and what they require, linked from .venv: torch
# included), so a wheel missing from the kit fails here. GPU tests skip; benches are not run.
# It prints the kit's size and each step's time against its budget (run_gpu.sh's summary).
#
#     PYVER=3.11 KIT=gpu_kit_py311 bash tools/gpu/build_kit.sh   # the kit for .venv's Python
#     bash tools/gpu/rehearse_cpu.sh gpu_kit_py311
#
# (Downloads about 25 MB once: not part of `make test`; tests/integration/test_gpu_kit.py runs it when
# XTUNER_ROPE_KIT_TEST=1.)
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=${1:-gpu_kit_py311}
WORK=${WORK:-/tmp/xtuner-rope-rehearsal}
rm -rf "$WORK" && mkdir -p "$WORK/image_site"
# Kit distributions (names normalised) are left out of the emulated image.
kit_names=$(python3 - "$KIT" <<'PY'
import json, re, sys
wheels = json.load(open(f"{sys.argv[1]}/part1/MANIFEST.json"))["wheels"]
print(" ".join(sorted({re.sub(r"[-_.]+", "-", w.split("-")[0]).lower() for w in wheels})))
PY
)
.venv/bin/python - "$WORK/image_site" "$kit_names" <<'PY'
import importlib.metadata as md, os, re, sys
from packaging.requirements import Requirement
dest, kit = sys.argv[1], set(sys.argv[2].split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
mods = [l.strip() for l in open("tools/gpu/image_modules.txt") if l.strip() and l[0] != "#"]
by_module = md.packages_distributions()
todo = [d for m in mods for d in by_module.get(m, [])]
seen = set()
while todo:
    name = norm(todo.pop())
    if name in seen or name in kit:
        continue
    seen.add(name)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    for req in dist.requires or []:
        r = Requirement(req)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            todo.append(r.name)
    tops = {str(f).split("/")[0] for f in dist.files or []}
    for top in tops:
        src = os.path.join(str(dist.locate_file("")), top)
        if top not in ("..", "bin") and os.path.exists(src) and not os.path.exists(os.path.join(dest, top)):
            os.symlink(src, os.path.join(dest, top))
print(f"emulated image: {len(seen)} distributions (torch and its CUDA libraries included)")
PY
py=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
# BUDGET_SCALE: the GPU machine's budgets, times 4 on this shared 2-core machine.
OUT=$WORK/out KIT=$KIT SITE=$WORK/site BASE_PYTHON=$py IMAGE_SITE=$WORK/image_site REHEARSAL=1 \
    BUDGET_SCALE=${BUDGET_SCALE:-4} bash tools/gpu/run_gpu.sh
