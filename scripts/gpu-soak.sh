#!/usr/bin/env bash
# Issue #4's 10-minute GPU soak, which no single device call (600 s, start-up included) can hold: two calls
# on one warm machine. The soak runs in its own process session (setsid), which outlives the first call.
#
#   call A: run(command="FACEGATE_CODE_COMMIT=<hash> bash scripts/gpu-soak.sh start",
#               carry=[".whlrun", ".lfwB", ".lfwT"], timeout_s=600)
#     runs the photo stage's GPU test ($OUT/gpu_tests_photo.txt), starts the soak (benchmarks/soak.py, 600 s of load after the server is ready, 6 client processes,
#     concurrency 64, facegate serve --workers 4 --compile graphs, fp16), then, while it runs, the GPU tests
#     ($OUT/gpu_tests.txt) and the memory probe (benchmarks/serve_memory.py: $OUT/serve_memory.json|.log;
#     its timings are taken beside the soak's load, so only its memory figures count); returns by ~585 s
#     with the soak's samples so far ($OUT/soak_gpu_partial.json).
#   call B, within the machine's 30 s warm window:
#         run(command="FACEGATE_CODE_COMMIT=<hash> bash scripts/gpu-soak.sh collect && <next work>", ...)
#     waits for the soak to end and copies $OUT/soak_gpu_mp.json and soak_gpu.log. MEMORY_VARIANTS (serve_memory.py
#     --variant values, space-separated) runs the memory probe first, while the soak still runs.
# scripts/gpu-photo.sh with SOAK_S=600 is another "start". SKIP_TESTS=1 skips the tests (carry .whlrun and .lfwB
# only, LFW_PROBE=.lfwB for the memory probe's photos); MEMORY_S=0 skips the memory probe.
# SOAK_IMAGES=.lfwT: the soak sends the GPU tests' 477 photos (carry .whlrun and .lfwT only, under the 64 MiB limit).
# SOAK_ARGS replaces the server's flags; SOAK_ENV ("KEY=VALUE ...") is the server's environment only (not the tests'),
# e.g. the low-memory mode: SOAK_ARGS="--device cuda --precision fp16 --compile off" SOAK_ENV="FACEGATE_ACTIVATION_BUDGET_MIB=16 ..."
set -uo pipefail
. scripts/device-env.sh
SOAK=/tmp/fg-soak
case "${1:-}" in
start)
  t0=$(date +%s)
  mkdir -p "$SOAK"
  # the photo stage's GPU test first: if it fails, the soak still runs, on the host path (and says so)
  # (SKIP_TESTS=1: no tests, e.g. when they passed in an earlier call of the session and .lfwT is not carried)
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    FACEGATE_LFW_ROOT=.lfwT timeout 150 python3 -m pytest -q -m gpu tests/unit/pipeline/test_photo.py -p no:cacheprovider \
      -s > "$OUT/gpu_tests_photo.txt" 2>&1 || export FACEGATE_GPU_PREPROCESS=off
    tail -1 "$OUT/gpu_tests_photo.txt"
  fi
  echo "soak with FACEGATE_GPU_PREPROCESS=${FACEGATE_GPU_PREPROCESS:-auto}"
  # shellcheck disable=SC2086
  setsid nohup env ${SOAK_ENV:-} python3 benchmarks/soak.py --duration "${SOAK_S:-600}" --window 15 --clients 6 \
    --concurrency 64 --images "${SOAK_IMAGES:-.lfwB}/lfw-deepfunneled" --out "$SOAK/soak_gpu_mp.json" -- \
    ${SOAK_ARGS:---device cuda --precision fp16 --compile graphs --workers 4} > "$SOAK/soak_gpu.log" 2>&1 < /dev/null &
  echo "soak started (pid $!)"
  unset FACEGATE_GPU_PREPROCESS
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    FACEGATE_LFW_ROOT=.lfwT timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu tests/unit -p no:cacheprovider -rs \
      > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
  fi
  VARIANTS=${VARIANTS:-"compile=graphs compile=graphs,gpu_preprocess=off rts_checkpoint=/tmp/irse64.pt,compile=graphs"}
  args=()
  for v in $VARIANTS; do args+=(--variant "$v"); done
  if [ "${MEMORY_S:-280}" != 0 ]; then
    FACEGATE_LFW_ROOT=${LFW_PROBE:-.lfwT} timeout "${MEMORY_S:-280}" python3 benchmarks/serve_memory.py --make-irse64 /tmp/irse64.pt \
      --out "$OUT/serve_memory.json" "${args[@]}" 2>&1 | tee "$OUT/serve_memory.log" | cut -c1-300
  fi
  while [ $(( $(date +%s) - t0 )) -lt "${RETURN_AT_S:-560}" ] && pgrep -f benchmarks/soak.py > /dev/null; do sleep 5; done
  cp "$SOAK/soak_gpu_mp.json" "$OUT/soak_gpu_partial.json" 2>/dev/null
  tail -2 "$SOAK/soak_gpu.log" | cut -c1-400
  ;;
collect)
  if [ -n "${MEMORY_VARIANTS:-}" ]; then  # the memory probe beside the soak's load (its memory figures count, not its seconds)
    args=()
    for v in $MEMORY_VARIANTS; do args+=(--variant "$v"); done
    FACEGATE_LFW_ROOT=${LFW_PROBE:-.lfwT} timeout "${MEMORY_S:-280}" python3 benchmarks/serve_memory.py --make-irse64 /tmp/irse64.pt \
      --out "$OUT/serve_memory.json" "${args[@]}" 2>&1 | tee "$OUT/serve_memory.log" | cut -c1-300
  fi
  while pgrep -f benchmarks/soak.py > /dev/null; do sleep 2; done
  cp "$SOAK/soak_gpu_mp.json" "$SOAK/soak_gpu.log" "$OUT/" || exit 4
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(len(d.get('samples',[])), 'windows', d.get('trend'), d.get('errors_total'))" \
    "$SOAK/soak_gpu_mp.json"
  ;;
*) echo "usage: $0 start|collect" >&2; exit 2 ;;
esac
