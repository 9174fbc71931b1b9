"""ServiceStats: counters, gauges, fixed-bucket histograms, snapshot, thread safety."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from facegate.errors import FacegateError
from facegate.metrics.stats import (
    BATCH_BUCKETS,
    Counter,
    Gauge,
    Histogram,
    HistogramSnapshot,
    ServiceStats,
)


def test_stats_module_does_not_import_prometheus_client() -> None:
    import facegate.metrics.stats as mod

    src = Path(mod.__file__).read_text(encoding="utf-8")
    assert "import prometheus_client" not in src and "from prometheus_client" not in src
    assert "prometheus_client" not in mod.__dict__


def test_counter_labels_and_values() -> None:
    c = Counter("x_total", "doc", ("route", "status"))
    c.labels("/a", 200).inc()
    c.labels("/a", "200").inc(2)  # status is stringified: the same series
    c.labels("/b", 500).inc()
    assert c.value("/a", 200) == 3.0
    assert c.value("/b", "500") == 1.0
    assert c.value("/nope", 1) == 0.0
    assert c.samples() == [(("/a", "200"), 3.0), (("/b", "500"), 1.0)]
    with pytest.raises(FacegateError):
        c.labels("/a")  # wrong arity
    with pytest.raises(FacegateError):
        c.labels("/a", 1).inc(-1)  # counters never decrease


def test_gauge_set_inc_dec_remove() -> None:
    g = Gauge("g", "doc", ("gallery",))
    g.labels("a").set(10)
    g.labels("a").inc(2)
    g.labels("a").dec(5)
    g.labels("b").set(1)
    assert g.value("a") == 7.0
    g.remove("b")
    assert g.samples() == [(("a",), 7.0)]
    u = Gauge("u", "doc")
    u.set(3)
    assert u.value() == 3.0


def test_histogram_buckets_are_le_and_cumulative() -> None:
    h = Histogram("h", "doc", buckets=(1.0, 2.0, 4.0))
    for v in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 100.0):
        h.observe(v)
    s = h.snapshot()
    # le semantics: 1.0 falls into the 1.0 bucket, 100 into +Inf.
    assert s.counts == (2, 2, 2, 1)
    assert s.cumulative() == [(1.0, 2), (2.0, 4), (4.0, 6), (float("inf"), 7)]
    assert s.count == 7 and s.sum == pytest.approx(112.0)
    assert s.mean == pytest.approx(16.0)
    with pytest.raises(FacegateError):
        Histogram("bad", "doc", buckets=(2.0, 1.0))


def test_histogram_quantile_interpolates() -> None:
    s = HistogramSnapshot(bounds=(1.0, 2.0), counts=(0, 10, 0), sum=15.0, count=10)
    assert s.quantile(0.5) == pytest.approx(1.5)
    assert s.quantile(1.0) == pytest.approx(2.0)
    over = HistogramSnapshot(bounds=(1.0, 2.0), counts=(0, 0, 5), sum=50.0, count=5)
    assert over.quantile(0.9) == 2.0  # +Inf bucket -> largest finite bound
    assert HistogramSnapshot((1.0,), (0, 0), 0.0, 0).quantile(0.5) is None


def test_observe_many_equals_observe() -> None:
    a = Histogram("a", "doc", buckets=BATCH_BUCKETS)
    b = Histogram("b", "doc", buckets=BATCH_BUCKETS)
    vals = [1, 3, 8, 64, 65, 5000]
    for v in vals:
        a.observe(v)
    b.labels().observe_many(vals)
    assert a.snapshot() == b.snapshot()


def test_thread_safety_exact_totals() -> None:
    stats = ServiceStats()
    n_threads, n_iter = 8, 2000

    def work() -> None:
        for _ in range(n_iter):
            stats.items.labels("embed").inc()
            stats.batch_size.labels("embed").observe(2)
            stats.queue_depth.labels("embed").inc()

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = n_threads * n_iter
    assert stats.items.value("embed") == total
    snap = stats.batch_size.snapshot("embed")
    assert snap.count == total and snap.sum == 2 * total
    assert stats.queue_depth.value("embed") == total


def test_mean_batch_size_and_record_batch() -> None:
    stats = ServiceStats()
    stats.register_stage("embed")
    assert stats.mean_batch_size("embed") == 0.0
    stats.record_batch("embed", 4, prepare_s=0.001, execute_s=0.01, deliver_s=0.0001)
    stats.record_batch("embed", 8, prepare_s=0.002, execute_s=0.02)
    assert stats.mean_batch_size("embed") == pytest.approx(6.0)
    assert stats.items.value("embed") == 12
    ex = stats.compute_seconds.snapshot("embed", "execute")
    assert ex.count == 2 and ex.sum == pytest.approx(0.03)
    assert stats.mean_batch_size("never-seen") == 0.0


def test_gpu_memory_refresh_and_failure_is_harmless() -> None:
    calls = {"n": 0}

    def mem() -> dict[str, float]:
        calls["n"] += 1
        return {"allocated": 100.0 * calls["n"], "reserved": 200.0, "peak": 150.0}

    stats = ServiceStats(gpu_memory_fn=mem)
    assert stats.refresh_gpu_memory() == {"allocated": 100.0, "reserved": 200.0, "peak": 150.0}
    snap = stats.snapshot()  # refreshes again
    assert snap["gpu_memory_bytes"] == {"allocated": 200.0, "peak": 150.0, "reserved": 200.0}

    def broken() -> dict[str, float]:
        raise RuntimeError("driver gone")

    stats.set_gpu_memory_source(broken)
    assert stats.refresh_gpu_memory() == {}
    assert stats.gpu_memory.value("allocated") == 200.0  # last good value kept


def test_snapshot_is_json_and_complete() -> None:
    stats = ServiceStats()
    stats.register_stage("detect")
    stats.record_request("/api/compare", 200, 0.02)
    stats.record_request("/api/compare", 503, 0.001)
    stats.record_batch("detect", 3, prepare_s=0.001, execute_s=0.004)
    stats.queue_wait.labels("detect").observe_many([0.001, 0.002, 0.003])
    stats.dropped.labels("detect", "expired").inc(2)
    stats.stage_errors.labels("detect", "execute").inc(3)
    stats.record_quality(0.72)
    stats.observe_quality(0.1)  # alias
    stats.record_refusal("low_quality")
    stats.set_gallery_size("staff", 12)

    snap = json.loads(json.dumps(stats.snapshot()))
    req = snap["requests"]["/api/compare"]
    assert req["by_status"] == {"200": 1.0, "503": 1.0}
    assert req["latency_s"]["count"] == 2
    det = snap["stages"]["detect"]
    assert det["items_total"] == 3 and det["batches_total"] == 1 and det["mean_batch_size"] == 3.0
    assert det["dropped"] == {"expired": 2.0, "cancelled": 0.0}
    assert det["errors"]["execute"] == 3.0
    assert det["queue_wait_s"]["count"] == 3 and det["queue_wait_s"]["sum"] == pytest.approx(0.006)
    assert det["compute_s"]["execute"]["count"] == 1
    assert det["batch_size"]["buckets"]["4.0"] == 1 and det["batch_size"]["buckets"]["2.0"] == 0
    assert snap["quality_score"]["count"] == 2 and snap["quality_score"]["buckets"]["0.75"] == 2
    assert snap["quality_score"]["buckets"]["0.1"] == 1
    assert snap["refusals"] == {"low_quality": 1.0}
    assert snap["galleries"] == {"staff": 12.0}
    assert snap["gpu_memory_bytes"] == {}
    stats.remove_gallery("staff")
    assert stats.snapshot()["galleries"] == {}


def test_engine_samples_of_several_engines_add_up() -> None:
    a, b = ServiceStats(), ServiceStats()
    for s, n in ((a, 2), (b, 3)):
        s.register_stage("embed")
        s.items.labels("embed").inc(n)
        s.batch_size.labels("embed").observe(n)
        s.queue_depth.labels("embed").set(n)
    merged = ServiceStats.merge_samples([a.engine_samples(), b.engine_samples()])
    assert set(merged) == set(ServiceStats.ENGINE_FAMILIES)
    assert dict(merged["facegate_items_total"])[("embed",)] == 5
    assert dict(merged["facegate_queue_depth"])[("embed",)] == 5
    snap = dict(merged["facegate_batch_size"])[("embed",)]
    assert snap.count == 2 and snap.sum == 5 and sum(snap.counts) == 2
