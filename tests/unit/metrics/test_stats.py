"""ServiceStats: recording helpers, reads, engine samples across engines, thread safety."""

from __future__ import annotations

import threading

import pytest

from facegate.metrics.stats import ENGINE_FAMILIES, ServiceStats, family_name


def record_batch(
    stats: ServiceStats, stage: str, size: int, prepare_s: float, execute_s: float, deliver_s: float
) -> None:
    """What the engine records for one executed batch."""
    stats.batch_size.labels(stage).observe(size)
    stats.items.labels(stage).inc(size)
    for phase, seconds in (("prepare", prepare_s), ("execute", execute_s), ("deliver", deliver_s)):
        stats.compute_seconds.labels(stage, phase).observe(seconds)


def test_labels_are_strings_and_counters_never_decrease() -> None:
    stats = ServiceStats()
    stats.requests.labels("/a", 200).inc()
    stats.requests.labels("/a", "200").inc(2)  # status is stringified: the same series
    assert stats.value("facegate_requests_total", route="/a", status="200") == 3.0
    assert stats.value("facegate_requests_total", route="/nope", status="1") == 0.0
    with pytest.raises(ValueError):
        stats.requests.labels("/a")  # wrong arity
    with pytest.raises(ValueError):
        stats.requests.labels("/a", 1).inc(-1)


def test_histogram_buckets_are_le_and_cumulative() -> None:
    stats = ServiceStats()
    for v in (0.05, 0.1, 0.12, 1.0):
        stats.quality_score.observe(v)
    assert stats.value("facegate_quality_score_bucket", le="0.1") == 2  # 0.1 falls into the 0.1 bucket
    assert stats.value("facegate_quality_score_bucket", le="0.15") == 3
    assert stats.value("facegate_quality_score_bucket", le="+Inf") == 4
    assert stats.value("facegate_quality_score_sum") == pytest.approx(1.27)


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
    assert stats.value("facegate_items_total", stage="embed") == total
    assert stats.value("facegate_batch_size_count", stage="embed") == total
    assert stats.value("facegate_batch_size_sum", stage="embed") == 2 * total
    assert stats.value("facegate_queue_depth", stage="embed") == total


def test_register_stage_and_record_batch() -> None:
    stats = ServiceStats()
    stats.register_stage("embed")
    assert stats.value("facegate_dropped_total", stage="embed", reason="expired") == 0.0
    assert stats.registry.get_sample_value("facegate_items_total", {"stage": "embed"}) == 0.0  # exists at zero
    assert stats.registry.get_sample_value("facegate_batch_size_count", {"stage": "embed"}) == 0.0
    record_batch(stats, "embed", 4, 0.001, 0.01, 0.0001)
    record_batch(stats, "embed", 8, 0.002, 0.02, 0.0)
    assert stats.value("facegate_batch_size_sum", stage="embed") == 12
    assert stats.value("facegate_batch_size_count", stage="embed") == 2
    assert stats.value("facegate_items_total", stage="embed") == 12
    assert stats.value("facegate_compute_seconds_count", stage="embed", phase="execute") == 2
    assert stats.value("facegate_compute_seconds_sum", stage="embed", phase="execute") == pytest.approx(0.03)
    assert stats.value("facegate_batch_size_count", stage="never-seen") == 0.0


def test_gpu_memory_refresh_and_failure_is_harmless() -> None:
    calls = {"n": 0}

    def mem() -> dict[str, float]:
        calls["n"] += 1
        return {"allocated": 100.0 * calls["n"], "reserved": 200.0, "peak": 150.0}

    stats = ServiceStats(gpu_memory_fn=mem)
    stats.refresh_gpu_memory()
    for kind, value in {"allocated": 100.0, "reserved": 200.0, "peak": 150.0}.items():
        assert stats.value("facegate_gpu_memory_bytes", kind=kind) == value
    stats.refresh_gpu_memory()
    assert stats.value("facegate_gpu_memory_bytes", kind="allocated") == 200.0

    def broken() -> dict[str, float]:
        raise RuntimeError("driver gone")

    stats.gpu_memory_fn = broken
    stats.refresh_gpu_memory()
    assert stats.value("facegate_gpu_memory_bytes", kind="allocated") == 200.0  # last good value kept


def test_gallery_sizes_hook_forgets_deleted_galleries() -> None:
    stats = ServiceStats()
    hook = stats.gallery_sizes_hook()
    hook({"staff": 12, "visitors": 3})
    assert stats.value("facegate_gallery_subjects", gallery="staff") == 12
    hook({"visitors": 4})
    assert stats.registry.get_sample_value("facegate_gallery_subjects", {"gallery": "staff"}) is None
    assert stats.value("facegate_gallery_subjects", gallery="visitors") == 4


def test_engine_samples_of_several_engines_add_up() -> None:
    a, b = ServiceStats(), ServiceStats()
    for s, n in ((a, 2), (b, 3)):
        s.register_stage("embed")
        s.items.labels("embed").inc(n)
        s.batch_size.labels("embed").observe(n)
        s.queue_depth.labels("embed").set(n)
        s.gallery_feed_lag.observe(0.01 * n)
    merged = ServiceStats.merge_samples([a.engine_samples(), b.engine_samples()])
    assert {family_name(m) for m in merged} == set(ENGINE_FAMILIES)
    values = {(s.name, tuple(s.labels.values())): s.value for m in merged for s in m.samples}
    assert values[("facegate_items_total", ("embed",))] == 5
    assert values[("facegate_queue_depth", ("embed",))] == 5
    assert values[("facegate_batch_size_sum", ("embed",))] == 5
    assert values[("facegate_batch_size_count", ("embed",))] == 2
    assert values[("facegate_batch_size_bucket", ("embed", "+Inf"))] == 2
    assert values[("facegate_batch_size_bucket", ("embed", "2.0"))] == 1
    assert values[("facegate_batch_size_bucket", ("embed", "4.0"))] == 2
    assert values[("facegate_gallery_feed_lag_seconds_sum", ())] == pytest.approx(0.05)


def test_every_engine_holds_the_whole_gallery_so_its_size_is_not_summed() -> None:
    a, b = ServiceStats(), ServiceStats()
    for s in (a, b):
        s.gallery_sizes_hook()({"staff": 12})
    merged = ServiceStats.merge_samples([a.engine_samples(), b.engine_samples()])
    values = {s.name: s.value for m in merged for s in m.samples if s.name == "facegate_gallery_subjects"}
    assert values == {"facegate_gallery_subjects": 12}
