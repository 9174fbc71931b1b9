"""/metrics across processes (prometheus_client multiprocess mode) and the gallery-label setting."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import values
from prometheus_client.parser import text_string_to_metric_families

from facegate.metrics import prometheus as prom
from facegate.metrics.stats import ServiceStats


def _samples(body: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


def _record(s: ServiceStats) -> None:
    s.record_request("GET /healthz", 200, 0.002)
    s.record_request("GET /healthz", 200, 0.3)
    s.record_request("POST /api/compare", 422, 0.02)
    s.quality_score.observe(0.7)
    s.refusals.labels("low_quality").inc()
    for v in (0.001, 0.004, 12.0):
        s.engine_call.labels("embed").observe(v)


@pytest.fixture
def shared_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(prom.MULTIPROC_ENV, str(tmp_path))
    prom.enable_multiprocess()
    assert prom._multiproc_dir == str(tmp_path)
    try:
        yield tmp_path
    finally:
        values.ValueClass = values.MutexValue
        prom._multiproc_dir = None


def test_shared_counters_and_histograms_expose_the_same_samples_as_local_ones(shared_dir: Path) -> None:
    shared = ServiceStats()
    _record(shared)
    body, _ = prom.render_latest(shared)
    values.ValueClass = values.MutexValue
    prom._multiproc_dir = None
    local = ServiceStats()
    _record(local)
    want, _ = prom.render_latest(local)
    got, exp = _samples(body), _samples(want)
    assert list(shared_dir.glob("*.db")), "nothing written to the multiprocess folder"
    for key in exp:
        if key[0].startswith(("facegate_process_info", "facegate_gpu")) or key[0].endswith("_created"):
            continue
        assert got.get(key) == pytest.approx(exp[key]), key
    assert got[("facegate_requests_total", frozenset({("route", "GET /healthz"), ("status", "200")}))] == 2


def test_a_dead_processes_counts_stay_in_the_totals(shared_dir: Path) -> None:
    s = ServiceStats()
    s.record_request("GET /healthz", 200, 0.001)
    prom.process_exited(999_999)  # another front-end went away: its counters are still part of the server
    got = _samples(prom.render_latest(s)[0])
    assert got[("facegate_requests_total", frozenset({("route", "GET /healthz"), ("status", "200")}))] == 1


def test_gallery_names_are_labels_only_when_allowed() -> None:
    s = ServiceStats()
    s.gallery_subjects.labels("staff-secret").set(3)
    s.gallery_subjects.labels("visitors").set(4)
    hidden = prom.render_latest(s, gallery_labels=False)[0]
    assert b"staff-secret" not in hidden and b"visitors" not in hidden
    assert _samples(hidden)[("facegate_gallery_subjects", frozenset())] == 7
    shown = _samples(prom.render_latest(s, gallery_labels=True)[0])
    assert shown[("facegate_gallery_subjects", frozenset({("gallery", "staff-secret")}))] == 3
