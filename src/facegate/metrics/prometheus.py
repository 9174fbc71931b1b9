"""The one Prometheus exporter: reads :class:`~facegate.metrics.stats.ServiceStats` at scrape time.

This is the only module that imports ``prometheus_client``. No global registry is touched: each
:func:`render_latest` call uses a private :class:`~prometheus_client.CollectorRegistry`, so any number
of services (and tests) can coexist in one process.

Exposed families (``images/s`` is ``rate(facegate_items_total[1m])``)::

    facegate_requests_total{route,status}          counter
    facegate_request_latency_seconds{route}        histogram
    facegate_engine_call_seconds{stage}            histogram   submit → answer, as the service sees it
    facegate_queue_depth{stage}                    gauge
    facegate_queue_wait_seconds{stage}             histogram
    facegate_batch_size{stage}                     histogram
    facegate_compute_seconds{stage,phase}          histogram   phase = prepare | execute | deliver
    facegate_items_total{stage}                    counter
    facegate_dropped_total{stage,reason}           counter     reason = expired | cancelled
    facegate_stage_errors_total{stage,phase}       counter
    facegate_quality_score                         histogram
    facegate_refusals_total{reason}                counter
    facegate_gallery_subjects{gallery}             gauge
    facegate_gpu_memory_bytes{kind}                gauge       kind = allocated | reserved | peak
    facegate_process_info{pid}                     gauge       1; the process that answered the scrape
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from facegate.metrics.stats import Counter, Gauge, Histogram, ServiceStats

try:  # prometheus_client >= 0.22 names the classic text format explicitly
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE
except ImportError:  # pragma: no cover - older clients: LATEST *is* the 0.0.4 text format
    from prometheus_client.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE


class ServiceStatsCollector(Collector):
    """A custom collector translating every :class:`ServiceStats` family into Prometheus metrics."""

    def __init__(self, stats: ServiceStats, remote: dict[str, list[Any]] | None = None) -> None:
        self.stats = stats
        self.remote = remote or {}

    def collect(self) -> Iterator[Metric]:
        """Yield one metric family per stats family (GPU memory refreshed first).

        A family present in ``remote`` (an engine process's :meth:`ServiceStats.engine_samples`) is exported
        with those samples instead of this process's.
        """
        self.stats.refresh_gpu_memory()
        for fam in self.stats.families():
            labels = list(fam.labelnames)
            samples = self.remote[fam.name] if fam.name in self.remote else fam.samples()
            if isinstance(fam, Counter):
                c = CounterMetricFamily(fam.name, fam.doc, labels=labels)
                for values, v in samples:
                    c.add_metric(list(values), v)
                yield c
            elif isinstance(fam, Gauge):
                g = GaugeMetricFamily(fam.name, fam.doc, labels=labels)
                for values, v in samples:
                    g.add_metric(list(values), v)
                yield g
            elif isinstance(fam, Histogram):
                h = HistogramMetricFamily(fam.name, fam.doc, labels=labels)
                for values, snap in samples:
                    buckets = [
                        ("+Inf" if math.isinf(le) else floatToGoString(le), float(n)) for le, n in snap.cumulative()
                    ]
                    h.add_metric(list(values), buckets, snap.sum)
                yield h


def make_registry(stats: ServiceStats, remote: dict[str, list[Any]] | None = None) -> CollectorRegistry:
    """A private registry holding only the collector for ``stats`` (and an engine process's ``remote`` samples)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceStatsCollector(stats, remote))
    return registry


def render_latest(stats: ServiceStats, remote: dict[str, list[Any]] | None = None) -> tuple[bytes, str]:
    """Prometheus text exposition of ``stats`` and its content type (for ``GET /metrics``).

    ``remote``: the engine process's samples of the engine families, for a front-end (process model).

    The content type is the classic ``text/plain; version=0.0.4`` that every Prometheus server parses
    (all facegate metric names are legacy-valid, so the body is the same in either text version).
    """
    return generate_latest(make_registry(stats, remote)), CONTENT_TYPE
