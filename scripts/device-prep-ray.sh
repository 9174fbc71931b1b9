#!/usr/bin/env bash
# Prepare the Ray Serve wheels for the GPU machine (Python 3.12, no internet, at most 64 MiB carried per call),
# in git-ignored folders of this checkout, next to scripts/device-prep.sh's .whlrun and .lfwT:
#   .whlrayA/ .whlrayB/ .whlrayC/   the ray wheel (~79 MB) cut in three pieces, one per call
#   .whlraydeps/                    ray[serve]'s other wheels that .whlrun and the device image lack (~31 MB)
# Carry them over three calls of one warm machine (scripts/gpu-ray.sh says how); the third call joins the
# pieces, installs everything into /tmp/site and runs the benchmark.
# Usage: bash scripts/device-prep-ray.sh [RAY_VERSION]   (default: the version in .venv)
set -euo pipefail
PY=${PY:-.venv/bin/python}
VERSION=${1:-$("$PY" -c 'import ray; print(ray.__version__)')}
for d in /.whlrayA/ /.whlrayB/ /.whlrayC/ /.whlraydeps/ /.raystash/; do
  grep -qxF "$d" "$(git rev-parse --git-common-dir)/info/exclude" || echo "$d" >> "$(git rev-parse --git-common-dir)/info/exclude"
done
tmp=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp" "ray[serve]==$VERSION"
rm -rf .whlrayA .whlrayB .whlrayC .whlraydeps && mkdir -p .whlrayA .whlrayB .whlrayC .whlraydeps
wheel=$(ls "$tmp"/ray-"$VERSION"-*.whl)
# pieces of a third each, rounded up: `cat .raystash/ray.whl.part-*` joins them again
split -n 3 -d "$wheel" "$tmp/ray.whl.part-"
mv "$tmp/ray.whl.part-00" .whlrayA/ && mv "$tmp/ray.whl.part-01" .whlrayB/ && mv "$tmp/ray.whl.part-02" .whlrayC/
basename "$wheel" > .whlrayC/NAME
rm "$wheel"
# numpy is on the device; .whlrun (scripts/device-prep.sh) brings the web stack
for w in "$tmp"/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
  case "$name" in numpy) continue ;; esac
  if ls .whlrun 2>/dev/null | cut -d- -f1 | tr 'A-Z-' 'a-z_' | grep -qxF "$name"; then continue; fi
  mv "$w" .whlraydeps/
done
rm -rf "$tmp"
du -sh .whlrayA .whlrayB .whlrayC .whlraydeps
