"""``GET /metrics``: the Prometheus text exposition of a :class:`~facegate.metrics.stats.ServiceStats`.

With several front-ends a scrape reaches one of them, so their counters and histograms live in files under
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode), summed at every scrape, exited processes
included, so counters never go backwards. Engine families come from the engine processes, gauges from the process
that answers; ``facegate_process_request*_total{pid}`` tell how evenly the front-ends share the work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from facegate.metrics.stats import Series, ServiceStats, family_name, to_series

#: The environment variable prometheus_client's multiprocess mode reads.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_multiproc_dir: str | None = None

try:  # prometheus_client >= 0.22 names the classic text format explicitly
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE
except ImportError:  # pragma: no cover - older clients: LATEST *is* the 0.0.4 text format
    from prometheus_client.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE


def enable_multiprocess() -> bool:
    """Keep this process's metrics in ``$PROMETHEUS_MULTIPROC_DIR`` (before its ServiceStats exists); whether it did."""
    global _multiproc_dir
    path = os.environ.get(MULTIPROC_ENV)
    if not path or not os.path.isdir(path):
        return False
    values.ValueClass = values.MultiProcessValue()
    _multiproc_dir = path
    return True


def process_exited(pid: int) -> None:
    """Bookkeeping for a front-end that exited (its counters stay: they are part of the server's totals)."""
    path = _multiproc_dir or os.environ.get(MULTIPROC_ENV)
    if path:
        mark_process_dead(pid, path)


def _family(kind: str, name: str, doc: str, labels: tuple[str, ...], series: Series) -> Metric:
    if kind == "histogram":
        h = HistogramMetricFamily(name, doc, labels=labels)
        for values_, (buckets, total) in series:
            h.add_metric(list(values_), list(buckets), total)
        return h
    m = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)
    for values_, v in series:
        m.add_metric(list(values_), v)
    return m


class _Collector(Collector):
    """``stats``'s families, with the engine's ``remote`` series in place of this process's, and, when the
    counters and histograms are shared, only this process's gauges (the sum of every process comes from
    :class:`_SharedCollector`)."""

    def __init__(self, stats: ServiceStats, remote: dict[str, Series], shared: bool, gallery_labels: bool) -> None:
        self.stats, self.remote, self.shared, self.gallery_labels = stats, remote, shared, gallery_labels

    def collect(self) -> Iterator[Metric]:
        self.stats.refresh_gpu_memory()
        for metric in self.stats.registry.collect():
            name = family_name(metric)
            hide = name == "facegate_gallery_subjects" and not self.gallery_labels
            if name not in self.remote and self.shared and metric.type != "gauge":
                continue
            if name not in self.remote and not hide:
                yield metric
                continue
            series = self.remote[name] if name in self.remote else to_series(metric)
            labels = self.stats.families[name][1]
            if hide:
                labels, series = (), [((), float(sum(v for _, v in series)))]
            yield _family(metric.type, name, metric.documentation, labels, series)
        if self.shared:
            yield from self._own_share()

    def _own_share(self) -> Iterator[Metric]:
        """This front-end's own requests (scrapes excluded) and their in-server seconds."""
        latency = to_series(self.stats.request_latency.collect()[0])
        own = [v for labels, v in latency if "/metrics" not in labels[0]]
        pid = (str(os.getpid()),)
        for name, what, value in (
            ("facegate_process_requests", "Requests", sum(buckets[-1][1] for buckets, _ in own)),
            ("facegate_process_request_seconds", "In-server seconds of the requests", sum(t for _, t in own)),
        ):
            doc = f"{what} this front-end process answered (scrapes excluded)."
            yield _family("counter", name, doc, ("pid",), [(pid, float(value))])


class _SharedCollector(MultiProcessCollector):
    """Every process's counters and histograms, summed; gauges and the engine's families are left out."""

    def __init__(self, path: str, skip: set[str]) -> None:
        super().__init__(None, path)
        self.skip = skip

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            if metric.type != "gauge" and family_name(metric) not in self.skip:
                yield metric


def render_latest(
    stats: ServiceStats, remote: dict[str, Series] | None = None, *, gallery_labels: bool = True
) -> tuple[bytes, str]:
    """The text exposition of ``stats`` (``text/plain; version=0.0.4``) with the engine's ``remote`` samples;
    without ``gallery_labels``, ``facegate_gallery_subjects`` is one unlabelled total."""
    remote = remote or {}
    registry = CollectorRegistry(auto_describe=False)
    shared = _multiproc_dir is not None and os.path.isdir(_multiproc_dir)
    registry.register(_Collector(stats, remote, shared, gallery_labels))
    if shared:
        registry.register(_SharedCollector(_multiproc_dir, set(remote)))
    return generate_latest(registry), CONTENT_TYPE
