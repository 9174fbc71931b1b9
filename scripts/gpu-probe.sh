#!/usr/bin/env bash
# One device call (~6 min) for issue #4: the GPU-marked tests, then where a serving process's GPU memory and
# cold start go (benchmarks/serve_memory.py: bare context, cuDNN/cuBLAS library floor, and per variant
# after build / warm-up / load, default models and a random-weight IR-SE-64). Writes under $OUT:
# gpu_tests.txt, serve_memory.json, serve_memory.log.
#
#   run(command="FACEGATE_CODE_COMMIT=<HEAD's hash, typed here> bash scripts/gpu-probe.sh",
#       carry=[".whlrun", ".lfwT"], timeout_s=600)
# .lfwT: pairs.txt plus the few LFW images the GPU tests read (git-ignored; never committed).
set -uo pipefail
. scripts/device-env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1
if [ "${TESTS_S:-200}" != 0 ]; then  # TESTS_S=0: memory only; TESTS: pytest paths (default tests/unit)
  FACEGATE_LFW_ROOT=.lfwT timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu ${TESTS:-tests/unit} -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
fi
# VARIANTS (space-separated) overrides the variants; the first run (commit 09f5862) also had
# compile=graphs,det_max_batch_pixels=1048576 and compile=off,precision=fp32.
VARIANTS=${VARIANTS:-"compile=graphs compile=graphs,det_graphs=false compile=off \
rts_checkpoint=/tmp/irse64.pt,compile=graphs rts_checkpoint=/tmp/irse64.pt,compile=off"}
# MEMORY_ARGS: more serve_memory.py arguments (word-split), e.g. "--trace --graph-probe"
args=()
for v in $VARIANTS; do args+=(--variant "$v"); done
for e in ${LIBRARIES_ENV:-}; do args+=(--libraries-env "$e"); done
timeout "${MEMORY_S:-330}" python3 benchmarks/serve_memory.py --make-irse64 /tmp/irse64.pt --out "$OUT/serve_memory.json" \
  "${args[@]}" ${MEMORY_ARGS:-} 2>&1 | tee "$OUT/serve_memory.log" | cut -c1-300
