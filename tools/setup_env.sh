#!/usr/bin/env bash
# Create .venv in the repository and install xtuner-rope with its dev extras, pinned by
# constraints.txt. Re-running it when nothing changed takes well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.xtuner-rope-installed
want=$(cat setup.cfg pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/xtuner ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# The CUDA build of torch (with its matching torchvision) runs on CPU-only machines too:
# PyPI has no CPU torchvision, and the CPU torch wheel breaks transformers' imports with it.
# uv installs the same pinned set from its cache in seconds where pip takes minutes (measured on
# the 2-core machine: about 18 s against about 2 min for a fresh .venv); pip when uv cannot be had.
if .venv/bin/python -m pip install --quiet uv -c constraints.txt && .venv/bin/uv --version >/dev/null 2>&1; then
    .venv/bin/uv pip install --quiet --python .venv/bin/python -e '.[dev,internvl]' -c constraints.txt
else
    .venv/bin/python -m pip install --quiet -e '.[dev,internvl]' -c constraints.txt
fi
echo "$want" > "$stamp"
echo "xtuner-rope installed in $(pwd)/.venv"
