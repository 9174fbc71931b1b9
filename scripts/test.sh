#!/usr/bin/env bash
# Run the whole test suite (unit, integration, e2e). GPU tests skip without CUDA; LFW tests skip
# without FACEGATE_LFW_ROOT (the Makefile points it at ../shared/data/lfw when that exists).
set -euo pipefail
VENV=${1:-.venv}
"$VENV/bin/ruff" check src tests benchmarks
"$VENV/bin/python" -m pytest -q --durations=15 tests
