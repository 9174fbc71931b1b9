"""Overload on this machine: 10× the capacity measured in the same run, against a real server process.

``perf``: left out of the default run (timing on a shared 2-core box); run with ``-m perf``. Bounded: a
few seconds of capacity, 15 s of overload. ``benchmarks/overload.py`` is the 60 s version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from overload_client import overload_run

pytestmark = [pytest.mark.perf, pytest.mark.slow]
log = logging.getLogger(__name__)


def test_ten_times_capacity(tmp_path: Path, lfw_root: Path, fg: SimpleNamespace) -> None:
    # the runner's thread count, as ``facegate serve`` on its own would have it
    env = {"FACEGATE_REQUEST_TIMEOUT_S": "10", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    srv = fg.ServeProcess(tmp_path, env=env)
    try:
        srv.wait_ready()
        photo = fg.lfw_image(lfw_root, "Colin_Powell", 1).read_bytes()
        other = fg.lfw_image(lfw_root, "Colin_Powell", 2).read_bytes()
        files = fg.files(img1=photo, img2=other)
        out = asyncio.run(
            overload_run(
                srv.url, "/api/compare", files, pid=srv.proc.pid, concurrency=16, capacity_s=6, overload_s=15, factor=10
            )
        )
    finally:
        srv.stop()
    log.warning("overload: %s", json.dumps(out))
    print(json.dumps(out, indent=1))
    o = out["overload"]
    assert out["goodput_ratio"] >= 0.9, out
    assert o["ok_p99_s"] <= 10.0, out  # within the deadline
    assert o["shed_p99_s"] is not None and o["shed_p99_s"] <= 0.05, out
    assert o["other"] == {}, out  # every request answered 2xx or 503
    # once the load stops, a new request waits at most for the admitted work (a quarter of the deadline)
    assert out["recovery_s"] is not None and out["recovery_s"] <= 10.0 / 4 + 2 * out["unloaded_p50_s"], out
    assert out["rss_growth"] is not None and out["rss_growth"] <= 0.25, out
