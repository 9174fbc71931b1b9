"""The one Prometheus exporter: reads :class:`~facegate.metrics.stats.ServiceStats` at scrape time.

This is the only module that imports ``prometheus_client``. No global registry is touched: each
:func:`render_latest` call uses a private :class:`~prometheus_client.CollectorRegistry`, so any number
of services (and tests) can coexist in one process.

With several front-end processes (``facegate serve --workers N``) a scrape reaches one of them. The
supervisor then gives the run a private ``PROMETHEUS_MULTIPROC_DIR`` (removed at exit; a crashed run's is
removed at the next start), and each front-end calls :func:`enable_multiprocess`: its counters and
histograms are also written to memory-mapped files there (prometheus_client's multiprocess mode), and every
scrape sums the files of all front-ends, those that exited included, so counters never go backwards. The
engine families come from the engine processes, gauges from the process that answers.

Gallery names are labels only with ``Settings.security.metrics_gallery_labels``; otherwise
``facegate_gallery_subjects`` is one unlabelled total.

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
    facegate_process_requests_total{pid}           counter     with several front-ends: this one's requests
    facegate_process_request_seconds_total{pid}    counter     ... and their in-server seconds
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from facegate.metrics import stats as stats_module
from facegate.metrics.stats import Counter, Gauge, Histogram, ServiceStats

log = logging.getLogger(__name__)

#: The environment variable prometheus_client's multiprocess mode reads.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_multiproc_dir: str | None = None


def enable_multiprocess() -> bool:
    """Share this process's counters and histograms through ``$PROMETHEUS_MULTIPROC_DIR`` (if set to a
    folder); returns whether it did. Call it before the process's :class:`ServiceStats` records anything."""
    global _multiproc_dir
    path = os.environ.get(MULTIPROC_ENV)
    if not path or not os.path.isdir(path):
        return False
    value_class = values.MultiProcessValue()

    def factory(kind: str, family: str, sample: str, names: tuple[str, ...], vals: tuple[str, ...], doc: str) -> Any:
        return value_class(kind, family, sample, names, vals, doc)

    stats_module.share_values(factory)
    _multiproc_dir = path
    return True


def process_exited(pid: int) -> None:
    """Bookkeeping for a front-end that exited (its counters stay: they are part of the server's totals)."""
    if _multiproc_dir is not None or os.environ.get(MULTIPROC_ENV):
        mark_process_dead(pid, _multiproc_dir or os.environ[MULTIPROC_ENV])


try:  # prometheus_client >= 0.22 names the classic text format explicitly
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE
except ImportError:  # pragma: no cover - older clients: LATEST *is* the 0.0.4 text format
    from prometheus_client.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE


class ServiceStatsCollector(Collector):
    """A custom collector translating every :class:`ServiceStats` family into Prometheus metrics."""

    def __init__(
        self,
        stats: ServiceStats,
        remote: dict[str, list[Any]] | None = None,
        *,
        shared: bool = False,
        gallery_labels: bool = True,
    ) -> None:
        self.stats = stats
        self.remote = remote or {}
        self.shared = shared
        self.gallery_labels = gallery_labels

    def collect(self) -> Iterator[Metric]:
        """Yield one metric family per stats family (GPU memory refreshed first).

        A family present in ``remote`` (an engine process's :meth:`ServiceStats.engine_samples`) is exported
        with those samples instead of this process's.
        """
        self.stats.refresh_gpu_memory()
        for fam in self.stats.families():
            labels = list(fam.labelnames)
            if fam.name in self.remote:
                samples = self.remote[fam.name]
            elif self.shared and isinstance(fam, Counter | Histogram):
                continue  # every front-end's series, summed by the MultiProcessCollector
            else:
                samples = fam.samples()
            if fam is self.stats.gallery_subjects and not self.gallery_labels:
                labels, samples = [], [((), float(sum(v for _, v in samples)))]
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
        if self.shared:
            yield from self._own_share()

    def _own_share(self) -> Iterator[Metric]:
        """This front-end's own requests (scrapes excluded): the families above are the whole server's, so
        these two tell how evenly the front-ends share the work."""
        own = [snap for values, snap in self.stats.request_latency.samples() if "/metrics" not in values[0]]
        pid = str(os.getpid())
        n = CounterMetricFamily(
            "facegate_process_requests", "Requests this front-end process answered (scrapes excluded).", labels=["pid"]
        )
        n.add_metric([pid], float(sum(s.count for s in own)))
        t = CounterMetricFamily(
            "facegate_process_request_seconds",
            "In-server seconds of the requests this front-end process answered (scrapes excluded).",
            labels=["pid"],
        )
        t.add_metric([pid], float(sum(s.sum for s in own)))
        yield n
        yield t


def make_registry(
    stats: ServiceStats, remote: dict[str, list[Any]] | None = None, *, gallery_labels: bool = True
) -> CollectorRegistry:
    """A private registry holding the collector for ``stats`` (and an engine process's ``remote`` samples),
    plus, after :func:`enable_multiprocess`, the sum of every front-end's counters and histograms."""
    registry = CollectorRegistry(auto_describe=False)
    shared = _multiproc_dir is not None and os.path.isdir(_multiproc_dir)
    registry.register(ServiceStatsCollector(stats, remote, shared=shared, gallery_labels=gallery_labels))
    if shared:
        MultiProcessCollector(registry, _multiproc_dir)
    return registry


def render_latest(
    stats: ServiceStats, remote: dict[str, list[Any]] | None = None, *, gallery_labels: bool = True
) -> tuple[bytes, str]:
    """Prometheus text exposition of ``stats`` and its content type (for ``GET /metrics``).

    ``remote``: the engine process's samples of the engine families, for a front-end (process model).
    ``gallery_labels``: whether ``facegate_gallery_subjects`` names the galleries (else one total).

    The content type is the classic ``text/plain; version=0.0.4`` that every Prometheus server parses
    (all facegate metric names are legacy-valid, so the body is the same in either text version).
    """
    return generate_latest(make_registry(stats, remote, gallery_labels=gallery_labels)), CONTENT_TYPE
