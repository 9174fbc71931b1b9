#!/usr/bin/env bash
# The 10-minute GPU soak (benchmarks/soak.py), which no single device call (600 s, start-up included) can
# hold: two calls on one warm machine. The soak runs in its own process session (setsid), which outlives
# the first call.
#
#   call A: run(command="FACEGATE_CODE_COMMIT=<hash> bash scripts/gpu-soak.sh start",
#               carry=[".whlrun", ".lfwB", ".lfwT"], timeout_s=600)
#     runs the photo stage's GPU test, starts the soak (600 s of load after the server is ready, 6 client
#     processes, concurrency 64, `facegate serve` with SOAK_ARGS, default none: the machine's plan), then,
#     while it runs, the GPU tests ($OUT/gpu_tests.txt) and the memory benchmark (serve_memory-h200.json;
#     only its memory figures count, since its timings share the machine with the soak); returns by
#     ~585 s with the soak's samples so far ($OUT/soak_partial.json).
#   call B, within the machine's warm window:
#         run(command="FACEGATE_CODE_COMMIT=<hash> bash scripts/gpu-soak.sh collect", ...)
#     waits for the soak to end and copies $OUT/soak-h200${PROFILE_SUFFIX}.json and soak.log.
# SKIP_TESTS=1 skips the tests; MEMORY_S=0 skips the memory benchmark; SOAK_IMAGES=.lfwT sends the GPU
# tests' photos (carry .whlrun and .lfwT only, under the 64 MiB limit). SOAK_ARGS replaces the server's
# flags and SOAK_ENV ("KEY=VALUE ...") is the server's environment only, e.g. the low-memory profile:
# SOAK_ARGS="--profile low-memory" PROFILE_SUFFIX=-low-memory.
set -uo pipefail
. scripts/device-env.sh
SOAK=/tmp/fg-soak
NAME="soak-h200${PROFILE_SUFFIX:-}.json"
case "${1:-}" in
start)
  t0=$(date +%s)
  mkdir -p "$SOAK"
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    FACEGATE_LFW_ROOT=.lfwT timeout 150 python3 -m pytest -q -m gpu tests/unit/pipeline/test_photo.py -p no:cacheprovider \
      -s > "$OUT/gpu_tests_photo.txt" 2>&1
    tail -1 "$OUT/gpu_tests_photo.txt"
  fi
  # shellcheck disable=SC2086
  setsid nohup env ${SOAK_ENV:-} python3 benchmarks/soak.py --duration "${SOAK_S:-600}" --window 15 --clients 6 \
    --concurrency 64 --images "${SOAK_IMAGES:-.lfwB}/lfw-deepfunneled" --out "$SOAK/$NAME" -- \
    ${SOAK_ARGS:-} > "$SOAK/soak.log" 2>&1 < /dev/null &
  echo "soak started (pid $!)"
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    FACEGATE_LFW_ROOT=.lfwT timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu tests/unit -p no:cacheprovider -rs \
      > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
  fi
  VARIANTS=${VARIANTS:-"compile=graphs rts_checkpoint=/tmp/irse64.pt,compile=graphs"}
  args=()
  for v in $VARIANTS; do args+=(--variant "$v"); done
  if [ "${MEMORY_S:-280}" != 0 ]; then
    FACEGATE_LFW_ROOT=${LFW_PROBE:-.lfwT} timeout "${MEMORY_S:-280}" python3 benchmarks/serve_memory.py --make-irse64 /tmp/irse64.pt \
      --out "$OUT/serve_memory-h200.json" "${args[@]}" 2>&1 | tee "$OUT/serve_memory-h200.log" | cut -c1-300
  fi
  while [ $(( $(date +%s) - t0 )) -lt "${RETURN_AT_S:-560}" ] && pgrep -f benchmarks/soak.py > /dev/null; do sleep 5; done
  cp "$SOAK/$NAME" "$OUT/soak_partial.json" 2>/dev/null
  tail -2 "$SOAK/soak.log" | cut -c1-400
  ;;
collect)
  while pgrep -f benchmarks/soak.py > /dev/null; do sleep 2; done
  cp "$SOAK/$NAME" "$SOAK/soak.log" "$OUT/" || exit 4
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(len(d.get('samples',[])), 'windows', d.get('trend'), d.get('errors_total'))" \
    "$SOAK/$NAME"
  ;;
*) echo "usage: $0 start|collect" >&2; exit 2 ;;
esac
