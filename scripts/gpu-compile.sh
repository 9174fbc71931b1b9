#!/usr/bin/env bash
# One device call (<= 9.5 min) for issue #4's model-only items: the GPU-marked tests, then
# benchmarks/compile_variants.py for IR-SE-64 at small batches (BN folding, layout, Inductor) and for SFace
# at batch 64 (Inductor max-autotune with a cold cache, then again with the cache it left). Each step gets
# what is left of the call's time (BUDGET_S), so a slow compile cuts the later steps, not the results.
# Writes under $OUT: gpu_tests.txt, compile_variants_*.json, compile_*.log.
#
#   run(command="FACEGATE_CODE_COMMIT=<HEAD's hash, typed here> bash scripts/gpu-compile.sh",
#       carry=[".whlrun", ".lfwT"], timeout_s=600)
set -uo pipefail
. scripts/device-env.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
BUDGET_S=${BUDGET_S:-560}
left() { echo $((BUDGET_S - SECONDS)); }
step() {  # step NAME CAP_S ARGS...: run compile_variants.py for at most min(CAP_S, time left) seconds
  local name=$1 cap=$2; shift 2
  local t; t=$(left); ((t > cap)) && t=$cap
  if ((t < 30)); then echo "skip $name: ${t}s left"; return; fi
  echo "== $name (${t}s cap, $(left)s left)"
  timeout "$t" python3 benchmarks/compile_variants.py "$@" --out "$OUT/compile_variants_$name.json" \
    > "$OUT/compile_$name.log" 2>&1
  echo "rc $?"; grep -E "img/s|Error|error" "$OUT/compile_$name.log" | cut -c1-220 | tail -8
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1
if [[ ${TESTS:-1} == 1 ]]; then
  FACEGATE_LFW_ROOT=.lfwT timeout 180 python3 -m pytest -q -m gpu tests/unit -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
fi
step irse64_graphs 120 --model irse64 --batches 1,8,64 --variants graphs,graphs-unfused,graphs-nchw
step irse64_inductor 170 --model irse64 --batches 1,8 --variants inductor --freezing --conv1x1-mm
step sface_cold 260 --model sface --batches 64 --variants graphs,inductor-max-autotune --freezing --conv1x1-mm
step sface_warm 200 --model sface --batches 64 --variants inductor-max-autotune --freezing --conv1x1-mm
du -sh "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null
