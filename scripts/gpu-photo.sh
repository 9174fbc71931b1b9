#!/usr/bin/env bash
# One device call (~8 min) for issue #4's photo-stage work: GPU tests of the changed code, the stage alone
# (benchmarks/photo_profile.py) for the code at hand and, when .oldsrc/src holds an older checkout's src/, for
# that code too (an A/B in one run), then HTTP end to end with the facegate_mp server under py-spy.
#
#   git archive <old commit> src | tar -x -C .oldsrc     # optional, git-ignored
#   run(command="FACEGATE_CODE_COMMIT=<hash> bash scripts/gpu-photo.sh",
#       carry=[".whlrun", ".lfwB", ".lfwT", ".pyspy", ".oldsrc"], timeout_s=600)
# .pyspy: the py-spy wheel (git-ignored). Writes under $OUT: gpu_tests.txt, photo_profile_{new,old}.json,
# http_gpu.json/.log, pyspy_facegate_mp.txt (raw; benchmarks/pyspy_summary.py summarises it).
# Environment: BUDGET_S (HTTP, default 240), SERVERS, CONCURRENCY. SOAK_S=600 then starts the 10-minute soak of
# scripts/gpu-soak.sh in its own session and returns at RETURN_AT_S (default 560 s after the start) with its
# samples so far; `bash scripts/gpu-soak.sh collect` in the next call (within the 30 s warm window) finishes it.
set -uo pipefail
. scripts/device-env.sh
FACEGATE_LFW_ROOT=.lfwT timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/models/test_detector.py \
  tests/unit/engine/test_graphs.py tests/unit/io/test_decode.py > "$OUT/gpu_tests.txt" 2>&1 \
  || { tail -n 30 "$OUT/gpu_tests.txt"; exit 3; }
tail -n 1 "$OUT/gpu_tests.txt"
FACEGATE_LFW_ROOT=.lfwT timeout 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/unit/pipeline/test_photo.py \
  > "$OUT/gpu_tests_photo.txt" 2>&1; grep -a "photo stage vs\|passed\|failed" "$OUT/gpu_tests_photo.txt" | cut -c1-300
prof="benchmarks/photo_profile.py --images .lfwB/lfw-deepfunneled --batches 54,128 --iters 20 --pipelined-s 3"
if [ -d .oldsrc/src ]; then
  PYTHONPATH=/tmp/site:$PWD/.oldsrc/src timeout 100 python3 $prof --label old --out "$OUT/photo_profile_old.json" 2>&1 \
    | grep "photo_profile batch"
fi
timeout 100 python3 $prof --label new --out "$OUT/photo_profile_new.json" 2>&1 | grep "photo_profile batch"
SPY=""
if ls .pyspy/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .pyspy/*.whl && SPY=/tmp/pyspy/bin/py-spy
fi
if [ -n "$SPY" ]; then
  export FACEGATE_BENCH_WRAP="facegate_mp=$SPY record --subprocesses --gil --nonblocking -r 97 -f raw -o $OUT/pyspy_facegate_mp.txt --"
fi
timeout $(( ${BUDGET_S:-240} + 60 )) python3 benchmarks/http_e2e.py --device cuda --precision fp16 --compile graphs \
  --peer-compile graphs --naive-serialize --mp-workers "${MP_WORKERS:-4}" \
  --servers "${SERVERS:-facegate_mp,naive,litserve}" --images .lfwB/lfw-deepfunneled \
  --concurrency "${CONCURRENCY:-100,256}" --duration 4 --budget-s "${BUDGET_S:-240}" \
  --out "$OUT/http_gpu.json" 2>&1 | grep -v '^\s*$' | tee "$OUT/http_gpu.log" | grep 'ready\|req/s\|bare\|Error'
if [ -n "${SOAK_S:-}" ]; then
  mkdir -p /tmp/fg-soak
  setsid nohup python3 benchmarks/soak.py --duration "$SOAK_S" --window 15 --clients 6 --concurrency 64 \
    --images .lfwB/lfw-deepfunneled --out /tmp/fg-soak/soak_gpu_mp.json -- --device cuda --precision fp16 \
    --compile graphs --workers 4 > /tmp/fg-soak/soak_gpu.log 2>&1 < /dev/null &
  echo "soak started (pid $!) at $SECONDS s"
  while [ "$SECONDS" -lt "${RETURN_AT_S:-560}" ] && pgrep -f benchmarks/soak.py > /dev/null; do sleep 5; done
  cp /tmp/fg-soak/soak_gpu_mp.json "$OUT/soak_gpu_partial.json" 2>/dev/null
  tail -n 2 /tmp/fg-soak/soak_gpu.log | cut -c1-400
fi
