#!/usr/bin/env bash
# Run the whole test suite (unit, integration, e2e). GPU tests skip without CUDA; LFW tests skip
# without FACEGATE_LFW_ROOT (the Makefile points it at ../shared/data/lfw when that exists); browser
# tests skip when Debian's chromium or playwright cannot be installed.
set -euo pipefail
VENV=${1:-.venv}
bash scripts/install-e2e.sh "$VENV" || echo "test.sh: e2e prerequisites incomplete; browser tests will skip"
"$VENV/bin/ruff" check src tests benchmarks
# the package's layers run one way (contracts in pyproject.toml, [tool.importlinter])
PYTHONPATH=src "$VENV/bin/lint-imports"
# one OpenMP thread per process on small CPU boxes: several torch processes (test server + client)
# share the cores, and oversubscription made CPU inference several times slower here
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$VENV/bin/python" -m pytest -q --durations=15 tests
