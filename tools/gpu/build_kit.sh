#!/usr/bin/env bash
# `make gpu-kit`: on a machine with registry access, the wheels the GPU machine lacks (Python
# 3.12, its own torch; see tools/gpu/kit_requirements.txt) plus xtuner-rope's own wheel, in ONE
# part, gpu_kit/part1, of at most PART_MIB (58) MiB: it travels with the working tree (about
# 4 MiB) in one call of at most 64 MiB. A kit that would need a second part is refused, naming
# its largest wheels. Then, on the GPU machine: bash tools/gpu/run_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# PYVER=3.11 KIT=gpu_kit_py311 builds the same kit for another Python (tests/integration/test_gpu_kit.py).
PYVER=${PYVER:-3.12}
if [ -z "${PY:-}" ]; then  # a working Python $PYVER (it builds DeepSpeed's wheel)
    for cand in python$PYVER /root/.pyenv/versions/$PYVER*/bin/python; do
        if "$cand" -c "import sys; assert sys.version.startswith('$PYVER.')" 2>/dev/null; then
            PY=$cand; break
        fi
    done
fi
: "${PY:?no Python $PYVER found: set PY=/path/to/python$PYVER}"
abi=cp${PYVER/./}
KIT=${KIT:-gpu_kit}
PART_MIB=${PART_MIB:-58}
DEEPSPEED=$(grep -i '^deepspeed==' constraints.txt)
stage=$KIT/wheels
rm -rf "$KIT"
mkdir -p "$stage" "$KIT/build"
echo "gpu-kit: third-party wheels for Python $PYVER ($PY)"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d "$stage" -r tools/gpu/kit_requirements.txt
# DeepSpeed is an sdist: a wheel without pre-built ops (they JIT-compile when used).
echo "gpu-kit: building $DEEPSPEED without ops"
"$PY" -m pip download --quiet --no-deps --no-binary=:all: -d "$KIT/build" "$DEEPSPEED"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps -w "$stage" "$KIT"/build/deepspeed-*.tar.gz
echo "gpu-kit: xtuner-rope wheel"
"$PY" -m pip wheel --quiet --no-deps -w "$stage" .
"$PY" tools/gpu/kit.py split "$stage" "$KIT" --part-mib "$PART_MIB" --max-parts 1
rm -rf "$KIT/build" "$stage"
echo "gpu-kit: $KIT is one part; carry it as \`carry: [\"$KIT\"]\` (docs/gpu.md)"
