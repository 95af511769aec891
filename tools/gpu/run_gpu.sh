#!/usr/bin/env bash
# The GPU run, in one command, on a GPU machine with no registry access (repository root):
#
#     bash tools/gpu/run_gpu.sh
#
# Needs the parts of `make gpu-kit` (gpu_kit/part1 .. partN, built where pip works, carried
# one part per call if need be: they stay on a warm machine). Installs the kit into a
# virtualenv over the machine's own torch (--system-site-packages, --no-index), then runs, each
# step under its own time limit (about 9 minutes in all):
#   1. pytest: tests/integration/test_gpu.py (the real varlen kernel against the reference, the gold tests
#      on CUDA in bf16 and fp16 for each packed backend, the seed failures), the CPU varlen glue
#      tests, and the CUDA tests of test_rope.py / test_attention.py;
#   2. `xtuner-rope check` on the tiny InternLM2 and Qwen2 recipes in bf16;
#   3. benches: RoPE apply against copy bandwidth, packed attention fwd+bwd (varlen, buckets,
#      dense mask, flex) on 2k/8k/32k packs, training tokens/s packed vs padded (1.8B shapes).
# Results land in $OUT (else work_dirs/gpu), at most 8 files: summary.txt (one line per step:
# exit code, seconds), env.txt, run.log (every step's output), pytest.xml, check_*.json,
# bench.txt. The exit code is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-work_dirs/gpu}
KIT=${KIT:-gpu_kit}
VENV=${VENV:-/tmp/xtuner-rope-gpu/venv}
BASE_PYTHON=${BASE_PYTHON:-python3}
IMAGE_SITE=${IMAGE_SITE:-}  # set by tools/gpu/rehearse_cpu.sh only
REHEARSAL=${REHEARSAL:-}  # CPU rehearsal: no GPU required, benches skipped
mkdir -p "$OUT" "$(dirname "$VENV")"
steps=$(dirname "$VENV")/steps
rm -rf "$steps" && mkdir -p "$steps"
: > "$OUT/summary.txt"
: > "$OUT/run.log"
failed=0

step() {  # step NAME SECONDS CMD...: run, log, one summary line
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" > "$steps/$name.log" 2>&1
    rc=$?
    { echo "===== $name (rc $rc): $*"; cat "$steps/$name.log"; } >> "$OUT/run.log"
    echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || { failed=$((failed + 1)); tail -n 5 "$steps/$name.log"; }
    return "$rc"
}

install_kit() {  # assemble the parts, install every wheel without an index or dependencies
    local wheels manifest_sha
    manifest_sha=$(sha256sum "$KIT/part1/MANIFEST.json" 2>/dev/null | cut -c1-16)
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.kit" 2>/dev/null)" = "$manifest_sha" ]; then
        echo "kit already installed in $VENV"; return 0
    fi
    "$BASE_PYTHON" tools/gpu/kit.py assemble "$KIT" "$VENV.wheels" || return 1
    rm -rf "$VENV" && "$BASE_PYTHON" -m venv --system-site-packages "$VENV" || return 1
    if [ -n "${IMAGE_SITE:-}" ]; then  # rehearsal (tools/gpu/rehearse_cpu.sh): the image's packages
        echo "$IMAGE_SITE" > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_image_site.pth"
    fi
    wheels=$(ls "$VENV".wheels/*.whl)
    "$VENV/bin/python" -m pip install --quiet --no-index --no-deps --no-compile $wheels || return 1
    echo "$manifest_sha" > "$VENV/.kit"
}

preflight() {  # the GPU, and every module the kit leaves to the image
    "$VENV/bin/python" - <<'EOF'
import importlib, platform, sys
import os
import torch
assert torch.cuda.is_available() or os.environ.get("REHEARSAL"), "torch sees no GPU"
names = [l.strip() for l in open("tools/gpu/image_modules.txt") if l.strip() and l[0] != "#"]
missing = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - report every missing module at once
        missing.append(f"{name} ({type(e).__name__}: {e})")
import deepspeed, mmengine, transformers, xtuner  # noqa: E401 - the kit's own
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, transformers {transformers.__version__}, "
      f"xtuner {xtuner.__version__}, mmengine {mmengine.__version__}, deepspeed {deepspeed.__version__}")
if missing:
    sys.exit("the image lacks: " + "; ".join(missing) + " -> add to tools/gpu/kit_requirements.txt")
EOF
}

export OUT KIT VENV BASE_PYTHON IMAGE_SITE REHEARSAL
export -f install_kit preflight
step install 240 install_kit || { echo "kit not installed: see $OUT/run.log"; exit 99; }
export PATH="$VENV/bin:$PATH" PYTHONPATH="$PWD" TOKENIZERS_PARALLELISM=false
step preflight 120 preflight || exit 98
{ cat "$steps/preflight.log"; nvidia-smi 2>&1 | head -15; } > "$OUT/env.txt"

step pytest 300 python -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
    -k "gpu or cuda or varlen" tests/integration/test_gpu.py tests/ops/test_attention_varlen.py \
    tests/ops/test_rope.py tests/ops/test_attention.py

if xtuner-rope check --help > /dev/null 2>&1; then
    dtype=$(xtuner-rope check --help | grep -q -- --dtype && echo "--dtype bfloat16")
    for recipe in tiny_internlm2 tiny_qwen2; do
        # shellcheck disable=SC2086
        step "check_$recipe" 90 xtuner-rope check "configs/${recipe}_short_dialogues.py" \
            --batches 2 --out "$steps/check_$recipe" $dtype
        cp "$steps/check_$recipe/report.json" "$OUT/check_$recipe.json" 2>/dev/null
    done
else
    echo "check: not run (this checkout has no \`xtuner-rope check\`)" | tee -a "$OUT/summary.txt"
fi

if [ -n "$REHEARSAL" ]; then
    echo "rehearsal: benches skipped; failed steps: $failed" | tee -a "$OUT/summary.txt"
    exit "$failed"
fi
: > "$OUT/bench.txt"
bench() {  # bench NAME SECONDS CMD...: a step whose output also goes to bench.txt
    local name=$1
    step "$@"
    local rc=$?
    { echo "== $name"; grep -v '^\s*$' "$steps/$name.log" | tail -n 40; } >> "$OUT/bench.txt"
    return "$rc"
}
bench rope_bf16 60 python tools/bench/rope.py --device cuda --dtype bf16 --seq 4096 --repeats 100
bench rope_bf16_bwd 60 python tools/bench/rope.py --device cuda --dtype bf16 --seq 4096 \
    --repeats 100 --backward
bench attention 120 python tools/bench/attention.py --device cuda --dtype bf16 \
    --tokens 2048 8192 32768
bench packing 150 python tools/bench/packing_gpu.py --device cuda --shapes internlm2-1.8b
echo "failed steps: $failed (results in $OUT)" | tee -a "$OUT/summary.txt"
exit "$failed"
