#!/usr/bin/env bash
# Install Debian's prometheus (for tests/integration/test_prometheus_scrape.py) when it is missing and apt
# can be used. Exits non-zero when it cannot install it; the test then skips, or fails under CI=true.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-prometheus.sh: no apt-get here" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "install-prometheus.sh: not root and no passwordless sudo" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends prometheus >/dev/null \
  || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null; }
# the package's own service is not wanted: the test runs its own instance on a free loopback port
command -v systemctl >/dev/null 2>&1 && $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
command -v prometheus >/dev/null 2>&1
