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
.venv/bin/python -m pip install --quiet -e '.[dev,internvl]' -c constraints.txt
echo "$want" > "$stamp"
echo "xtuner-rope installed in $(pwd)/.venv"
