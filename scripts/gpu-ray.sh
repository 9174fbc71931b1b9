#!/usr/bin/env bash
# Ray Serve with one GPU's worth of engine replicas against `facegate serve` with no flags, in one run on the GPU machine: compare
# req/s at concurrency 100 and 256 with LFW photos -> $OUT/http_e2e-h200-ray.json (rewritten after every point)
# and $OUT/ray_http_gpu.log. Run from the root of the checkout the device gets; CODE is the tree to measure
# (default: this one), e.g. a copy made with `rsync -a --exclude results src benchmarks scripts .dev_x/`:
#   bash scripts/device-prep.sh && bash scripts/device-prep-ray.sh      # here, once (git-ignored folders)
#   run(command="CODE=.dev_x STAGE=1 bash .dev_x/scripts/gpu-ray.sh", carry=[".whlray", ".lfwT", ".dev_x"])
#   run(command="bash /tmp/raystash/code/scripts/gpu-ray.sh", carry=[".whlraydeps", ".whlrun"], timeout_s=600)
# Both calls must reach one warm machine (it goes back after ~30 s idle: send the second at once): the first
# only stashes ray, the photos and the code in $STASH (/tmp, kept on a warm machine), as the two calls' folders
# exceed what one call carries. SERVERS, CONCURRENCY, DURATION_S and BUDGET_S override the defaults below.
# Before/after two trees (e.g. main's and a branch's): both calls once per tree, CODE=.dev_main then CODE=.dev_new,
# with the same SERVERS (default facegate_default,facegate_ray_w8), and FACEGATE_CODE_COMMIT=<its commit> for each.
set -uo pipefail
STASH=${STASH:-/tmp/raystash}
mkdir -p "$STASH"
if [ "${STAGE:-2}" = 1 ]; then
  cp .whlray/ray.zip "$STASH"/ && cp -r .lfwT "$STASH"/ && rm -rf "$STASH/code" && cp -r "${CODE:-.}" "$STASH/code"
  du -sh "$STASH"
  exit 0
fi
[ -f "$STASH/ray.zip" ] || { echo "no $STASH/ray.zip: run STAGE=1 on this machine first"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whlrun/*.whl .whlraydeps/*.whl || exit 3
# unpack with the files' modes (the raylet and GCS binaries are executables; `python -m zipfile` drops modes)
STASH="$STASH" python3 - <<'PYEOF' || exit 3
import os, zipfile
with zipfile.ZipFile(os.environ["STASH"] + "/ray.zip") as z:
    for info in z.infolist():
        path = z.extract(info, "/tmp/site")
        if info.external_attr >> 16:
            os.chmod(path, (info.external_attr >> 16) & 0o777)
PYEOF
cd "$STASH/code" || exit 2
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FACEGATE_LOG_LEVEL=WARNING RAY_USAGE_STATS_ENABLED=0
export PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c 'import ray, ray.serve; print("ray", ray.__version__)' || exit 4
# facegate_default: `facegate serve` with no flags; facegate_ray_w8: `facegate ray` with 8 ingress replicas (the
# plan's front-end count on this machine) and one GPU's worth of engine replicas (the plan's engines per GPU)
timeout $(( ${BUDGET_S:-300} + 90 )) python3 benchmarks/http_e2e.py --device cuda --precision fp16 --compile graphs \
  --servers "${SERVERS:-facegate_default,facegate_ray_w8}" --kinds compare \
  --images "$STASH/.lfwT/lfw-deepfunneled" --concurrency "${CONCURRENCY:-100,256}" --duration "${DURATION_S:-4}" \
  --budget-s "${BUDGET_S:-300}" --keep-logs /tmp/server_logs --out "$OUT/http_e2e-h200-ray.json" 2>&1 \
  | grep -v '^\s*$' | tee "$OUT/ray_http_gpu.log" | grep 'ready\|req/s\|Error\|facegate'
[ -d /tmp/server_logs ] && tar czf "$OUT/server_logs.tar.gz" -C /tmp server_logs
