# Sourced by the device scripts (gpu-http.sh, gpu-probe.sh, gpu-soak.sh): install the carried wheels (.whlrun, made by
# scripts/device-prep.sh) into /tmp/site, put them and src/ on PYTHONPATH, and create $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whlrun/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 FACEGATE_LOG_LEVEL=WARNING
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
