#!/usr/bin/env bash
# Ray Serve with one engine replica against `facegate serve` (one process) and its multi-process form, in one
# run on the GPU machine: compare req/s at concurrency 100 and 256 with LFW photos -> $OUT/ray_http_gpu.json.
#
#   bash scripts/device-prep.sh && bash scripts/device-prep-ray.sh      # here, once (git-ignored folders)
#   run(command="STAGE=1 bash scripts/gpu-ray.sh", carry=[".whlrayA", ".whlrun", ".lfwT"])
#   run(command="STAGE=2 bash scripts/gpu-ray.sh", carry=[".whlrayB", ".whlraydeps"])
#   run(command="bash scripts/gpu-ray.sh", carry=[".whlrayC"], timeout_s=600)
# The three calls must reach one warm machine: the first two only stash their pieces in .raystash/ (git-
# ignored, kept between calls). SERVERS, CONCURRENCY, DURATION_S and BUDGET_S override the defaults below.
set -uo pipefail
mkdir -p .raystash
case "${STAGE:-3}" in
  1) cp -r .whlrayA/. .whlrun .lfwT .raystash/ && du -sh .raystash && exit 0 ;;
  2) cp -r .whlrayB/. .raystash/ && cp .whlraydeps/*.whl .raystash/ && du -sh .raystash && exit 0 ;;
esac
cp -r .whlrayC/. .raystash/
cat .raystash/ray.whl.part-* > "/tmp/$(cat .raystash/NAME)" || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .raystash/.whlrun/*.whl .raystash/*.whl "/tmp/$(cat .raystash/NAME)" || exit 3
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FACEGATE_LOG_LEVEL=WARNING RAY_USAGE_STATS_ENABLED=0
export PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c 'import ray, ray.serve; print("ray", ray.__version__)' || exit 4
timeout $(( ${BUDGET_S:-420} + 90 )) python3 benchmarks/http_e2e.py --device cuda --precision fp16 --compile graphs \
  --servers "${SERVERS:-facegate,facegate_ray,facegate_mp,facegate_ray_w4}" --kinds compare \
  --images .raystash/.lfwT/lfw-deepfunneled --concurrency "${CONCURRENCY:-100,256}" --duration "${DURATION_S:-4}" \
  --budget-s "${BUDGET_S:-420}" --keep-logs /tmp/server_logs --out "$OUT/ray_http_gpu.json" 2>&1 \
  | grep -v '^\s*$' | tee "$OUT/ray_http_gpu.log" | grep 'ready\|req/s\|Error\|facegate'
[ -d /tmp/server_logs ] && tar czf "$OUT/server_logs.tar.gz" -C /tmp server_logs
