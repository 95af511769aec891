#!/usr/bin/env bash
# Create .venv in the repository and install xtuner-rope with its dev extras, pinned by
# constraints.txt. Re-running it when nothing changed takes well under a second.
# tools/test_compat.sh reuses it for its own environments through three variables:
#   VENV         the environment's folder (default .venv)
#   CONSTRAINTS  the constraints file (default constraints.txt)
#   PINS         extra requirements installed in the same pip call ("torch==2.4.1 ...")
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
CONSTRAINTS=${CONSTRAINTS:-constraints.txt}
PINS=${PINS:-}
stamp=$VENV/.xtuner-rope-installed
# The stamp covers this script too: a change of how to install (e.g. --compile-bytecode)
# reinstalls an existing .venv.
want=$({ cat setup.cfg pyproject.toml "$CONSTRAINTS" tools/setup_env.sh; printf '%s' "$PINS"; } | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/xtuner" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# The CUDA build of torch (with its matching torchvision) runs on CPU-only machines too:
# PyPI has no CPU torchvision, and the CPU torch wheel breaks transformers' imports with it.
# uv installs the same pinned set from its cache in seconds where pip takes minutes (measured on
# the 2-core machine: about 18 s against about 2 min for a fresh .venv); pip when uv cannot be had.
# --compile-bytecode: uv writes no .pyc by default (pip does). Where PYTHONDONTWRITEBYTECODE is
# set (this machine and CI), no import ever writes one either, so every process compiled torch,
# DeepSpeed and transformers from source: `import deepspeed` took 17.8 s of CPU instead of 7.0 s,
# in every `xtuner train` a test starts (CI went from ~32 to ~58 minutes with uv without it).
# shellcheck disable=SC2086  # PINS is a list of requirements
if "$VENV/bin/python" -m pip install --quiet uv -c "$CONSTRAINTS" && "$VENV/bin/uv" --version >/dev/null 2>&1; then
    "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" \
        -e '.[dev,internvl]' $PINS -c "$CONSTRAINTS"
else
    "$VENV/bin/python" -m pip install --quiet -e '.[dev,internvl]' $PINS -c "$CONSTRAINTS"
fi
echo "$want" > "$stamp"
echo "xtuner-rope installed in $(pwd)/$VENV"
