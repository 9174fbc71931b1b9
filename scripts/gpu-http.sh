#!/usr/bin/env bash
# One device call (at most 600 s) of the end-to-end GPU benchmark, as issue #4 asks for it next:
# facegate in one process, facegate with one engine process and 4 front-ends (facegate_mp), the seed-style
# naive server and LitServe, compare + aligned-embed requests. Writes $OUT/http_gpu.json (rewritten after
# every point, so a time-out keeps what was measured) and $OUT/http_gpu.log.
#
#   bash scripts/device-prep.sh                       # here, once: wheels + LFW halves (git-ignored)
#   run(command="FACEGATE_CODE_COMMIT=<HEAD's hash, typed here> bash scripts/gpu-http.sh",
#       carry=[".whlrun", ".lfwB", ".lfwT"], timeout_s=600)
# When .lfwT (the few LFW images the GPU tests read, see scripts/gpu-probe.sh) is there, the GPU tests of
# the CUDA-graph code run first ($OUT/gpu_tests_http.txt), and a failure stops the call before the servers.
# (the device's copy of .git is the session's first commit, so the hash must be spelled out)
#
# SKIP_TESTS=1 skips those tests (when the call ran the whole GPU suite before this script).
# Environment: BUDGET_S (default 420) bounds the benchmark; DURATION_S (default 4) is each point's measured time;
# KEEP_LOGS=1 brings the servers' logs back; SERVERS, CONCURRENCY and MP_WORKERS override the
# defaults below. Lessons of the last runs: each server takes ~30 s to get ready on a cold machine, so four
# servers leave ~5 minutes for points; the important concurrencies go first.
set -uo pipefail
. scripts/device-env.sh
if [ -d .lfwT ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
  FACEGATE_LFW_ROOT=.lfwT timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/engine/test_graphs.py \
    tests/unit/models/test_detector.py > "$OUT/gpu_tests_http.txt" 2>&1 || { tail -30 "$OUT/gpu_tests_http.txt"; exit 3; }
  tail -1 "$OUT/gpu_tests_http.txt"
  # the photo stage's parity with the host path: printed (-s), not fatal (its tolerances are the measurement)
  FACEGATE_LFW_ROOT=.lfwT timeout 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/unit/pipeline/test_photo.py \
    > "$OUT/gpu_tests_photo.txt" 2>&1; grep -a "photo stage vs\|passed\|failed" "$OUT/gpu_tests_photo.txt" | cut -c1-300
fi
# PYSPY_SERVER=NAME (with the py-spy wheel carried in .pyspy): record that server's processes under py-spy
# (--gil, raw) into $OUT/pyspy_NAME.txt. EXTRA_ARGS: more http_e2e.py arguments (word-split).
if [ -n "${PYSPY_SERVER:-}" ] && ls .pyspy/*.whl > /dev/null 2>&1 \
  && python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .pyspy/*.whl; then
  export FACEGATE_BENCH_WRAP="$PYSPY_SERVER=/tmp/pyspy/bin/py-spy record --subprocesses --gil --nonblocking -r 97 \
-f raw -o $OUT/pyspy_$PYSPY_SERVER.txt --"
fi
rm -rf /tmp/server_logs  # a machine may be handed back warm, with an earlier call's logs there
# shellcheck disable=SC2086
timeout $(( ${BUDGET_S:-420} + 60 )) python3 benchmarks/http_e2e.py --device cuda --precision fp16 --compile graphs \
  --peer-compile graphs --naive-serialize --mp-workers "${MP_WORKERS:-4}" \
  --servers "${SERVERS:-facegate_mp,facegate,litserve,naive}" --images .lfwB/lfw-deepfunneled \
  --concurrency "${CONCURRENCY:-100,256,16,1}" --duration "${DURATION_S:-4}" --budget-s "${BUDGET_S:-420}" \
  $( [ "${KEEP_LOGS:-0}" = 1 ] && echo --keep-logs /tmp/server_logs ) ${EXTRA_ARGS:-} \
  --out "$OUT/http_gpu.json" 2>&1 | grep -v '^\s*$' | tee "$OUT/http_gpu.log" | grep 'ready\|req/s\|bare\|Error'
# KEEP_LOGS=1: every server's log, in one archive ($OUT takes at most 8 files): $OUT/server_logs.tar.gz
if [ "${KEEP_LOGS:-0}" = 1 ] && [ -d /tmp/server_logs ]; then
  tar czf "$OUT/server_logs.tar.gz" -C /tmp server_logs
fi
