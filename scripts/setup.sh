#!/usr/bin/env bash
# Create the virtual environment and install facegate with its dev and ray extras.
# On a machine without an NVIDIA GPU, install the CPU build of torch first (torch==2.13.0+cpu), so that
# pyproject's torch range is already satisfied and pip never pulls a multi-GB CUDA build: from the configured
# indexes when they hold it (a local wheel mirror), else from PyTorch's CPU index (PyPI's Linux torch is the
# CUDA build). TORCH_CPU_INDEX names a mirror of that index.
set -euo pipefail
PYTHON=${1:-python3}
VENV=${2:-.venv}
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "facegate needs Python >= 3.11"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
if ! "$PY" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q 'torch>=2.4'
  else
    "$PY" -m pip install -q torch==2.13.0+cpu 2>/dev/null \
      || "$PY" -m pip install -q --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" torch==2.13.0
  fi
fi
# the ray extra: the Ray Serve tests (tests/integration/test_ray_serve.py) run in CI, they skip only outside it
"$PY" -m pip install -q -e '.[dev,ray]'
echo "facegate installed in $VENV (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
