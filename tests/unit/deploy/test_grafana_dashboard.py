"""deploy/grafana/facegate-dashboard.json: well-formed, and every metric and label it uses is exported.

The exported names are taken from what :func:`facegate.metrics.prometheus.render_latest` actually writes
for a :class:`~facegate.metrics.stats.ServiceStats` with one sample in every family.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from facegate.metrics.prometheus import render_latest
from facegate.metrics.stats import ServiceStats

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "facegate-dashboard.json"
METRIC_RE = re.compile(r"\bfacegate_[a-z0-9_]+\b")
BY_RE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHER_RE = re.compile(r"\{([^}]*)\}")
#: labels every scrape adds, plus the histogram bucket label
SCRAPE_LABELS = {"instance", "job", "le"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Sample name → its label names, as written by the exporter (one sample in every family)."""
    stats = ServiceStats()
    families = [v for v in vars(stats).values() if isinstance(v, MetricWrapperBase)]
    assert len(families) == len(list(stats.registry.collect()))  # every family is an attribute
    for fam in families:
        labelnames = fam._labelnames
        child = fam.labels(*["x"] * len(labelnames)) if labelnames else fam
        if isinstance(fam, Counter):
            child.inc()
        elif isinstance(fam, Gauge):
            child.set(1.0)
        elif isinstance(fam, Histogram):
            child.observe(0.5)
    body, _ = render_latest(stats)
    names: dict[str, set[str]] = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        head = line.rsplit(" ", 1)[0]
        name, _, labels = head.partition("{")
        keys = {kv.split("=", 1)[0] for kv in labels.rstrip("}").split(",") if "=" in kv}
        names.setdefault(name, set()).update(keys)
    return names


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` of every target and every query variable."""
    out: list[tuple[str, str]] = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']}", q))
    return out


def test_well_formed(dashboard: dict[str, Any]) -> None:
    for key in ("title", "uid", "panels", "schemaVersion", "templating", "time"):
        assert key in dashboard, key
    panels = dashboard["panels"]
    assert len(panels) >= 15
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    var_names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= var_names
    occupied: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24 and g["h"] >= 1, (p["title"], g)
        cells = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
        if p["type"] == "row":
            continue
        assert p["title"] and p.get("description"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"


def test_promql_is_balanced_and_filtered(dashboard: dict[str, Any]) -> None:
    for title, expr in queries(dashboard):
        for a, b in ("()", "{}", "[]"):
            depth = 0
            for ch in expr:
                depth += (ch == a) - (ch == b)
                assert depth >= 0, (title, expr)
            assert depth == 0, (title, expr)
        assert expr.count('"') % 2 == 0, (title, expr)
        if not title.startswith("variable"):
            for sel in MATCHER_RE.findall(expr):
                assert 'instance=~"$instance"' in sel, f"{title}: selector without the instance filter: {sel}"


def test_every_metric_and_label_is_exported(dashboard: dict[str, Any], exported: dict[str, set[str]]) -> None:
    used: set[str] = set()
    for title, expr in queries(dashboard):
        names = set(METRIC_RE.findall(expr))
        assert names, f"{title}: no facegate metric in {expr}"
        missing = names - set(exported)
        assert not missing, f"{title}: {sorted(missing)} not exported (exported: {sorted(exported)})"
        used |= names
        allowed = SCRAPE_LABELS.union(*(exported[n] for n in names))
        for group in BY_RE.findall(expr):
            labels = {x.strip() for x in group.split(",") if x.strip()}
            assert labels <= allowed, f"{title}: grouping by unknown labels {labels - allowed}"
        for sel in MATCHER_RE.findall(expr):
            labels = {m.split("=")[0].rstrip("!~").strip() for m in sel.split(",") if "=" in m}
            assert labels <= allowed, f"{title}: matcher on unknown labels {labels - allowed}"
    required = {
        "facegate_requests_total",
        "facegate_request_latency_seconds_bucket",
        "facegate_queue_depth",
        "facegate_queue_wait_seconds_bucket",
        "facegate_batch_size_sum",
        "facegate_batch_size_count",
        "facegate_compute_seconds_sum",
        "facegate_items_total",
        "facegate_quality_score_bucket",
        "facegate_refusals_total",
        "facegate_gallery_subjects",
        "facegate_gpu_memory_bytes",
    }
    assert required <= used, f"dashboard lacks {sorted(required - used)}"


def test_latency_quantiles(dashboard: dict[str, Any]) -> None:
    exprs = [e for _, e in queries(dashboard) if "facegate_request_latency_seconds_bucket" in e]
    for q in ("0.5", "0.95", "0.99"):
        assert any(e.startswith(f"histogram_quantile({q}, sum by (le") for e in exprs), q
    batch = [e for _, e in queries(dashboard) if "facegate_batch_size_sum" in e]
    assert any("facegate_batch_size_count" in e and "by (stage)" in e for e in batch)
