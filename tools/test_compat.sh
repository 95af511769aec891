#!/usr/bin/env bash
# `make test-compat`: the fast tests (and real 2-process DeepSpeed ZeRO-2/3 `xtuner train` runs)
# on torch and DeepSpeed releases other than the pins, each in its own environment
# .venv-compat-<torch>-<deepspeed> (git-ignored; built once, a few GB each, reused).
#
#   bash tools/test_compat.sh                       # the default matrix below
#   bash tools/test_compat.sh 2.4.1:0.19.1:0.19.0   # TORCH:TORCHVISION:DEEPSPEED entries
#   COMPAT_STEPS="install run" bash tools/test_compat.sh   # a subset of install, fast, run
#
# Everything but torch, torchvision, DeepSpeed and what moves with torch (triton and the
# CUDA libraries) stays at constraints.txt. torchvision must be torch's own pair (PyPI has only
# CUDA builds, and a mismatched one breaks transformers' imports: torchvision::nms missing).
# Exits non-zero if any step of any entry failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# Oldest and newest torch of the supported range besides the pin (2.15.0), each with a
# DeepSpeed release besides the pin (0.19.6): the oldest one whose ZeRO runs on CPU, and 0.19.5.
MATRIX=${COMPAT_MATRIX:-"2.4.1:0.19.1:0.19.0 2.14.1:0.29.1:0.19.5"}
[ $# -gt 0 ] && MATRIX="$*"
STEPS=${COMPAT_STEPS:-"install fast run"}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
failed=()

step_install() {  # $1 venv, $2 torch, $3 torchvision, $4 deepspeed
    local constraints="$1/constraints.txt"
    mkdir -p "$1"
    grep -v -E '^(torch|torchvision|triton|deepspeed|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==' \
        constraints.txt > "$constraints"
    VENV=$1 CONSTRAINTS=$constraints PINS="torch==$2 torchvision==$3 deepspeed==$4" \
        bash tools/setup_env.sh
}

step_fast() {  # $1 venv
    PATH="$PWD/$1/bin:$PATH" python -m pytest -q -p no:cacheprovider -n 0 \
        --basetemp="$1/pytest" --ignore=tests/integration -m "not slow"
}

# The real runs: XTuner's own launcher, 2 CPU processes under DeepSpeed ZeRO-2 and ZeRO-3
# (gloo), losses against one process (`xtuner-rope train` returns the run's status; the test
# also reads both ranks' logs and the checkpoint). XTUNER_ROPE_AGAIN=1: the ZeRO-2 case is
# opt-in in `make test` (tests/support/opt_in.py), where test_resume's 1-vs-2 step proves it.
step_run() {  # $1 venv
    PATH="$PWD/$1/bin:$PATH" XTUNER_ROPE_AGAIN=1 python -m pytest -q -p no:cacheprovider -n 0 \
        --basetemp="$1/pytest-run" \
        "tests/integration/test_multiprocess.py::test_two_processes_match_one[internlm2-zero2]" \
        "tests/integration/test_multiprocess.py::test_two_processes_match_one[internlm2-zero3]"
}

for entry in $MATRIX; do
    IFS=: read -r torch torchvision deepspeed <<< "$entry"
    if [ -z "$deepspeed" ]; then
        echo "test_compat: entry '$entry' is not TORCH:TORCHVISION:DEEPSPEED" \
            "(e.g. 2.4.1:0.19.1:0.19.0)" >&2
        exit 2
    fi
    venv=".venv-compat-$torch-$deepspeed"
    # Each environment compiles DeepSpeed's CPU ops against its own torch.
    export TORCH_EXTENSIONS_DIR="$PWD/$venv/torch_extensions"
    for step in $STEPS; do
        echo "=== test_compat $entry: $step ($(date -u +%H:%M:%S))"
        start=$SECONDS
        if [ "$step" = install ]; then
            step_install "$venv" "$torch" "$torchvision" "$deepspeed" \
                && "$venv/bin/python" -c 'import torch, torchvision, deepspeed, mmengine, xtuner, transformers as t
print("versions: torch", torch.__version__, "torchvision", torchvision.__version__,
      "deepspeed", deepspeed.__version__, "mmengine", mmengine.__version__,
      "xtuner", xtuner.__version__, "transformers", t.__version__)'
        else
            "step_$step" "$venv"
        fi
        rc=$?
        echo "=== test_compat $entry: $step rc=$rc in $((SECONDS - start)) s"
        [ $rc -eq 0 ] || failed+=("$entry:$step")
    done
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "test_compat FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test_compat passed: $MATRIX"
