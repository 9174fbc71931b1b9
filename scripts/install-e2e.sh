#!/usr/bin/env bash
# Install what the browser end-to-end tests (tests/e2e) need, idempotently:
#   * Debian's chromium at /usr/bin/chromium (apt-get, only when absent and we are root);
#   * the Python `playwright` package in the venv (pip, only when not importable).
# It never runs `playwright install`: the tests drive the system chromium through
# `executable_path='/usr/bin/chromium'`, so no browser is downloaded by Playwright.
# Usage: bash scripts/install-e2e.sh [VENV]   (default .venv). Missing pieces only make the e2e tests
# skip (with a reason), so a failure here is reported but does not abort `make test`.
set -uo pipefail
VENV=${1:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=python3
status=0

if [ -x /usr/bin/chromium ]; then
  echo "install-e2e: chromium present ($(/usr/bin/chromium --version 2>/dev/null || echo 'version unknown'))"
elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "install-e2e: installing chromium with apt-get"
  if ! (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium); then
    echo "install-e2e: apt-get could not install chromium; the e2e tests will skip" >&2
    status=1
  fi
else
  echo "install-e2e: /usr/bin/chromium is missing and we are not root (or have no apt-get);" \
       "install it (e.g. 'sudo apt-get install chromium') or the e2e tests will skip" >&2
  status=1
fi

if "$PY" -c 'import playwright.sync_api' >/dev/null 2>&1; then
  echo "install-e2e: playwright present ($("$PY" -m pip show playwright 2>/dev/null | sed -n 's/^Version: //p'))"
else
  echo "install-e2e: installing playwright into $VENV"
  if ! "$PY" -m pip install -q playwright; then
    echo "install-e2e: pip could not install playwright; the e2e tests will skip" >&2
    status=1
  fi
fi
exit $status
