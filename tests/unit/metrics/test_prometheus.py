"""The Prometheus exporter: names, label sets and values read from ServiceStats at scrape time."""

from __future__ import annotations

import os

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from facegate.metrics.prometheus import render_latest
from facegate.metrics.stats import ServiceStats


def _samples(body: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(body.decode("utf-8")):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


@pytest.fixture
def stats() -> ServiceStats:
    s = ServiceStats(gpu_memory_fn=lambda: {"allocated": 1024.0, "reserved": 4096.0, "peak": 2048.0})
    s.register_stage("embed")
    s.record_request("/api/compare", 200, 0.02)
    s.record_request("/api/compare", 200, 0.2)
    s.record_request("/api/compare", 503, 0.001)
    for size, prepare_s, execute_s, deliver_s in ((8, 0.001, 0.01, 0.0002), (2, 0.001, 0.004, 0.0001)):
        s.batch_size.labels("embed").observe(size)
        s.items.labels("embed").inc(size)
        for phase, seconds in (("prepare", prepare_s), ("execute", execute_s), ("deliver", deliver_s)):
            s.compute_seconds.labels("embed", phase).observe(seconds)
    s.queue_depth.labels("embed").set(5)
    s.queue_wait.labels("embed").observe(0.0005)
    s.queue_wait.labels("embed").observe(0.003)
    s.dropped.labels("embed", "expired").inc(3)
    s.dropped.labels("embed", "cancelled").inc(1)
    s.quality_score.observe(0.31)
    s.quality_score.observe(0.92)
    s.refusals.labels("low_quality").inc()
    s.gallery_subjects.labels("staff").set(42)
    return s


def test_content_type_and_all_names(stats: ServiceStats) -> None:
    body, ctype = render_latest(stats)
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype
    text = body.decode()
    for name in (
        "facegate_requests_total",
        "facegate_request_latency_seconds_bucket",
        "facegate_queue_depth",
        "facegate_queue_wait_seconds_bucket",
        "facegate_batch_size_bucket",
        "facegate_compute_seconds_bucket",
        "facegate_items_total",
        "facegate_dropped_total",
        "facegate_quality_score_bucket",
        "facegate_refusals_total",
        "facegate_gallery_subjects",
        "facegate_gpu_memory_bytes",
        "facegate_process_info",
    ):
        assert name in text, name
    assert f'facegate_process_info{{pid="{os.getpid()}"}} 1.0' in text
    assert "# TYPE facegate_batch_size histogram" in text
    assert "# TYPE facegate_requests_total counter" in text
    assert "# TYPE facegate_queue_depth gauge" in text


def test_values(stats: ServiceStats) -> None:
    body, _ = render_latest(stats)
    s = _samples(body)
    assert s[_key("facegate_requests_total", route="/api/compare", status="200")] == 2
    assert s[_key("facegate_requests_total", route="/api/compare", status="503")] == 1
    # latency histogram: 0.001 <= 0.001 bucket; 0.02 <= 0.025; 0.2 <= 0.25
    assert s[_key("facegate_request_latency_seconds_bucket", route="/api/compare", le="0.001")] == 1
    assert s[_key("facegate_request_latency_seconds_bucket", route="/api/compare", le="0.025")] == 2
    assert s[_key("facegate_request_latency_seconds_bucket", route="/api/compare", le="+Inf")] == 3
    assert s[_key("facegate_request_latency_seconds_count", route="/api/compare")] == 3
    assert s[_key("facegate_request_latency_seconds_sum", route="/api/compare")] == pytest.approx(0.221)
    assert s[_key("facegate_queue_depth", stage="embed")] == 5
    assert s[_key("facegate_queue_wait_seconds_count", stage="embed")] == 2
    assert s[_key("facegate_batch_size_bucket", stage="embed", le="2.0")] == 1
    assert s[_key("facegate_batch_size_bucket", stage="embed", le="8.0")] == 2
    assert s[_key("facegate_batch_size_sum", stage="embed")] == 10
    assert s[_key("facegate_batch_size_count", stage="embed")] == 2
    assert s[_key("facegate_compute_seconds_sum", stage="embed", phase="execute")] == pytest.approx(0.014)
    assert s[_key("facegate_compute_seconds_count", stage="embed", phase="prepare")] == 2
    assert s[_key("facegate_items_total", stage="embed")] == 10
    assert s[_key("facegate_dropped_total", stage="embed", reason="expired")] == 3
    assert s[_key("facegate_dropped_total", stage="embed", reason="cancelled")] == 1
    assert s[_key("facegate_quality_score_bucket", le="0.35")] == 1
    assert s[_key("facegate_quality_score_count")] == 2
    assert s[_key("facegate_refusals_total", reason="low_quality")] == 1
    assert s[_key("facegate_gallery_subjects", gallery="staff")] == 42
    assert s[_key("facegate_gpu_memory_bytes", kind="allocated")] == 1024
    assert s[_key("facegate_gpu_memory_bytes", kind="reserved")] == 4096
    assert s[_key("facegate_gpu_memory_bytes", kind="peak")] == 2048


def test_scrape_reads_live_values_and_uses_no_global_registry(stats: ServiceStats) -> None:
    before = set(REGISTRY._names_to_collectors)
    body1, _ = render_latest(stats)
    stats.items.labels("embed").inc(5)
    body2, _ = render_latest(stats)
    assert _samples(body1)[_key("facegate_items_total", stage="embed")] == 10
    assert _samples(body2)[_key("facegate_items_total", stage="embed")] == 15
    assert set(REGISTRY._names_to_collectors) == before
    assert not any(n.startswith("facegate_") for n in REGISTRY._names_to_collectors)
    # Two independent holders in one process do not interfere.
    other = ServiceStats()
    assert _key("facegate_items_total", stage="embed") not in _samples(render_latest(other)[0])
