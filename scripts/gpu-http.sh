#!/usr/bin/env bash
# One device call (at most 600 s) of the HTTP end-to-end GPU benchmark: facegate with no tuning flag, the
# hand-tuned facegate, the naive server and LitServe, one after another on the same machine and client.
# Writes $OUT/$NAME.json (NAME defaults to http_e2e-h200; rewritten after every point, so a time-out keeps what
# was measured) and $OUT/$NAME.log; copy the JSON to benchmarks/results/ and run `python benchmarks/tables.py`.
#
#   bash scripts/device-prep.sh                       # here, once: wheels + LFW halves (git-ignored)
#   run(command="FACEGATE_CODE_COMMIT=<HEAD's hash> bash scripts/gpu-http.sh",
#       carry=[".whlrun", ".lfwB", ".lfwT"], timeout_s=600)
# The device's copy of .git may be older than the code, so the commit is spelled out.
# When .lfwT is there, the GPU tests of the CUDA-graph code run first and a failure stops the call.
# Environment: SKIP_TESTS=1 skips those tests; BUDGET_S (default 420) bounds the benchmark; DURATION_S
# (default 4) is each point's measured time; SERVERS and CONCURRENCY override the defaults below
# (benchmarks/server_variants.py names the servers); KEEP_LOGS=1 brings the servers' logs back;
# EXTRA_ARGS: more http_e2e.py arguments (word-split); IMAGES: the photos (default .lfwB/lfw-deepfunneled).
# A server takes up to ~30 s to get ready, so the important concurrencies go first. The gallery search and
# bulk enrolment at 1M subjects, against compare in the same run (carry .lfwH instead of .lfwB):
#   SERVERS=facegate_default CONCURRENCY=100 IMAGES=.lfwH/lfw-deepfunneled NAME=http_e2e-h200-search \
#     EXTRA_ARGS="--kinds compare,search,enrol --gallery-size 1000000" bash scripts/gpu-http.sh
set -uo pipefail
. scripts/device-env.sh
if [ -d .lfwT ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
  # the CUDA-graph and detector tests, wherever the package layout keeps them
  FACEGATE_LFW_ROOT=.lfwT timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/*/test_graphs.py \
    tests/unit/*/test_detector.py > "$OUT/gpu_tests_http.txt" 2>&1 || { tail -30 "$OUT/gpu_tests_http.txt"; exit 3; }
  tail -1 "$OUT/gpu_tests_http.txt"
fi
rm -rf /tmp/server_logs  # a machine may be handed back warm, with an earlier call's logs there
# shellcheck disable=SC2086
timeout $(( ${BUDGET_S:-420} + 60 )) python3 benchmarks/http_e2e.py --device cuda --precision fp16 --compile graphs \
  --peer-compile graphs --naive-serialize \
  --servers "${SERVERS:-facegate_default,facegate_mp_w8_e3_det64,naive,litserve}" --images "${IMAGES:-.lfwB/lfw-deepfunneled}" \
  --concurrency "${CONCURRENCY:-100,256}" --duration "${DURATION_S:-4}" --budget-s "${BUDGET_S:-420}" \
  $( [ "${KEEP_LOGS:-0}" = 1 ] && echo --keep-logs /tmp/server_logs ) ${EXTRA_ARGS:-} \
  --out "$OUT/${NAME:-http_e2e-h200}.json" 2>&1 | grep -v '^\s*$' | tee "$OUT/${NAME:-http_e2e-h200}.log" \
  | grep 'ready\|req/s\|bare\|gallery\|Error'
if [ "${KEEP_LOGS:-0}" = 1 ] && [ -d /tmp/server_logs ]; then  # one archive: $OUT takes few files
  tar czf "$OUT/server_logs.tar.gz" -C /tmp server_logs
fi
