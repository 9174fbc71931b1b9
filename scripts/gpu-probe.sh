#!/usr/bin/env bash
# One device call (~6 min): the GPU-marked tests, then where a serving process's GPU memory and cold start go
# (benchmarks/serve_memory.py: a bare CUDA context, the cuDNN/cuBLAS floor, and per variant after build,
# warm-up and load; the default models and a random-weight IR-SE-64). Writes under $OUT: gpu_tests.txt,
# serve_memory-h200.json, serve_memory-h200.log.
#
#   run(command="FACEGATE_CODE_COMMIT=<HEAD's hash> bash scripts/gpu-probe.sh", carry=[".whlrun", ".lfwT"], timeout_s=600)
# .lfwT: pairs.txt plus the few LFW images the GPU tests read (git-ignored; never committed).
# Environment: TESTS_S=0 skips the tests (TESTS: their paths, default tests/unit); VARIANTS (space-separated
# serve_memory.py --variant values) replaces the variants; MEMORY_ARGS adds serve_memory.py arguments.
set -uo pipefail
. scripts/device-env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1
if [ "${TESTS_S:-200}" != 0 ]; then
  FACEGATE_LFW_ROOT=.lfwT timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu ${TESTS:-tests/unit} -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
fi
VARIANTS=${VARIANTS:-"compile=graphs compile=off rts_checkpoint=/tmp/irse64.pt,compile=graphs"}
args=()
for v in $VARIANTS; do args+=(--variant "$v"); done
# shellcheck disable=SC2086
timeout "${MEMORY_S:-330}" python3 benchmarks/serve_memory.py --make-irse64 /tmp/irse64.pt --out "$OUT/serve_memory-h200.json" \
  "${args[@]}" ${MEMORY_ARGS:-} 2>&1 | tee "$OUT/serve_memory-h200.log" | cut -c1-300
