#!/usr/bin/env bash
# Run the whole test suite (unit, integration, e2e). GPU tests skip without CUDA; LFW tests skip
# without FACEGATE_LFW_ROOT (the Makefile points it at ../shared/data/lfw when that exists); browser
# tests skip when Debian's chromium or playwright cannot be installed; the Prometheus test skips when Debian's
# prometheus cannot be installed (it fails instead under CI=true).
set -euo pipefail
VENV=${1:-.venv}
bash scripts/install-e2e.sh "$VENV" || echo "test.sh: e2e prerequisites incomplete; browser tests will skip"
# Debian's prometheus for the scrape test of the Grafana dashboard (about 30 s to install)
bash scripts/install-prometheus.sh || echo "test.sh: prometheus not installed; its test skips (fails under CI=true)"
# Debian's PostgreSQL server for the gallery store's contract tests (run as the postgres user; fail under CI=true
# when missing)
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql >/dev/null 2>&1 \
    || echo "test.sh: postgresql not installed; its tests skip (fail under CI=true)"
fi
"$VENV/bin/ruff" check src tests benchmarks
"$VENV/bin/ruff" format --check src tests benchmarks
# the package's layers run one way (contracts in pyproject.toml, [tool.importlinter])
PYTHONPATH=src "$VENV/bin/lint-imports"
# one OpenMP thread per process on small CPU boxes: several torch processes (test server + client)
# share the cores, and oversubscription made CPU inference several times slower here
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$VENV/bin/python" -m pytest -q --durations=15 tests
