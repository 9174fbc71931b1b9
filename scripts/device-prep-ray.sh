#!/usr/bin/env bash
# Prepare the Ray Serve wheels for the GPU machine (Python 3.12, no internet, at most 64 MiB carried per call),
# in git-ignored folders of this checkout, next to scripts/device-prep.sh's .whlrun and .lfwT:
#   .whlray/ray.zip   the ray wheel without its Java worker (~47 of 79 MB), to unpack into /tmp/site
#   .whlraydeps/      ray[serve]'s other wheels that .whlrun and the device image lack (~35 MB)
# Carry them in two calls of one warm machine (scripts/gpu-ray.sh says how).
# Usage: bash scripts/device-prep-ray.sh [RAY_VERSION]   (default: the version in .venv)
set -euo pipefail
PY=${PY:-.venv/bin/python}
VERSION=${1:-$("$PY" -c 'import ray; print(ray.__version__)')}
for d in /.whlray/ /.whlraydeps/ /.raystash/; do
  grep -qxF "$d" "$(git rev-parse --git-common-dir)/info/exclude" || echo "$d" >> "$(git rev-parse --git-common-dir)/info/exclude"
done
tmp=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp" "ray[serve]==$VERSION"
rm -rf .whlrayA .whlrayB .whlrayC .whlray .whlraydeps && mkdir -p .whlray .whlraydeps
wheel=$(ls "$tmp"/ray-"$VERSION"-*.whl)
# the wheel without its Java worker (ray/jars, 32 of its 79 MB), unpacked on the device instead of pip-installed
python3 - "$wheel" .whlray/ray.zip <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if not info.filename.startswith("ray/jars/"):
            dst.writestr(info, src.read(info))
PYEOF
rm "$wheel"
# numpy is on the device; .whlrun (scripts/device-prep.sh) brings the web stack
for w in "$tmp"/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
  case "$name" in numpy) continue ;; esac
  if ls .whlrun 2>/dev/null | cut -d- -f1 | tr 'A-Z-' 'a-z_' | grep -qxF "$name"; then continue; fi
  mv "$w" .whlraydeps/
done
rm -rf "$tmp"
du -sh .whlray .whlraydeps
