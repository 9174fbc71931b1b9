"""benchmarks/monitor.py: the time breakdown adds up each front-end process's own counters."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
monitor = pytest.importorskip("monitor")


def _hist(latency: tuple[float, float], engine_call: tuple[float, float], wait: tuple[float, float]) -> dict:
    return {
        ("request_latency_seconds", "/api/compare"): {"sum": latency[0], "count": latency[1]},
        ("engine_call_seconds", "photo"): {"sum": engine_call[0], "count": engine_call[1]},
        ("queue_wait_seconds", "photo"): {"sum": wait[0], "count": wait[1]},
    }


def _snapshot(by_pid: dict[str, dict], last: str) -> dict[str, Any]:
    return {"hist": by_pid[last], "gpu_memory_mib": {}, "by_pid": by_pid}


def test_front_end_families_are_summed_per_process_engine_families_are_not() -> None:
    # two front-ends with very different totals; the engine family is the same merged copy in both
    before = _snapshot(
        {"11": _hist((10.0, 100), (8.0, 200), (1.0, 500)), "12": _hist((1.0, 10), (0.8, 20), (1.0, 500))}, last="11"
    )
    after = _snapshot(
        {"11": _hist((14.0, 150), (11.0, 300), (3.0, 900)), "12": _hist((2.0, 30), (1.6, 60), (3.0, 900))}, last="12"
    )
    tb = monitor.time_breakdown(before, after, wall_s=1.0)
    # (4 + 1) s over (50 + 20) requests; (3 + 0.8) s over (100 + 40) calls; (2 s over 400 waits, once)
    assert tb["server_latency_ms"]["/api/compare"] == pytest.approx(1000 * 5.0 / 70, abs=1e-3)
    assert tb["engine_call_ms"]["photo"] == pytest.approx(1000 * 3.8 / 140, abs=1e-3)
    assert tb["queue_wait_ms"]["photo"] == pytest.approx(1000 * 2.0 / 400, abs=1e-3)


def test_a_process_seen_in_only_one_snapshot_is_left_out() -> None:
    before = _snapshot({"11": _hist((10.0, 100), (8.0, 200), (1.0, 5))}, last="11")
    after = _snapshot(
        {"11": _hist((11.0, 110), (9.0, 210), (2.0, 10)), "13": _hist((50.0, 60), (50.0, 60), (2.0, 10))}, last="13"
    )
    tb = monitor.time_breakdown(before, after, wall_s=1.0)
    assert tb["server_latency_ms"]["/api/compare"] == pytest.approx(100.0)
    assert tb["engine_call_ms"]["photo"] == pytest.approx(100.0)


def test_front_end_spread_gives_each_front_ends_share_and_latency_largest_first() -> None:
    metrics = {("request_latency_seconds", "GET /metrics"): {"sum": 5.0, "count": 1000}}  # scrapes: left out
    before = _snapshot(
        {"11": {**_hist((10.0, 100), (0, 0), (0, 0)), **metrics}, "12": _hist((1.0, 10), (0, 0), (0, 0))}, last="11"
    )
    after = _snapshot(
        {"11": {**_hist((14.0, 150), (0, 0), (0, 0)), **metrics}, "12": _hist((7.0, 160), (0, 0), (0, 0))}, last="12"
    )
    spread = monitor.front_end_spread(before, after)
    # 150 new requests at 40 ms on pid 12, 50 at 80 ms on pid 11
    assert spread["share"] == [0.75, 0.25]
    assert spread["mean_ms"] == pytest.approx([40.0, 80.0])


def test_cpu_by_role_lists_each_front_ends_cores_busiest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    roles = {1: "supervisor", 2: "engine", 3: "front-end", 4: "front-end"}
    monkeypatch.setattr(monitor, "process_roles", lambda pids, engines=1: roles)
    tck = monitor.CLK_TCK
    th0 = {(2, 20): 0, (3, 30): 0, (3, 31): 0, (4, 40): 0}
    th1 = {(2, 20): 2 * tck, (3, 30): tck // 2, (3, 31): tck // 2, (4, 40): 3 * tck}
    out = monitor.cpu_by_role(th0, th1, list(roles), wall=2.0)
    assert out["cores_by_role"] == {"engine": 1.0, "front-end": 2.0}
    assert out["front_end_cores"] == [1.5, 0.5]  # pid 4, then pid 3's two threads together
    assert out["top_thread_role"] == "front-end"
