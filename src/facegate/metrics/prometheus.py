"""``GET /metrics``: the Prometheus text exposition of a :class:`~facegate.metrics.stats.ServiceStats`.

With several front-ends a scrape reaches one of them, so their counters and histograms live in files under
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode), summed at every scrape, exited processes
included, so counters never go backwards. Engine families come from the engine processes, gauges from the process
that answers; ``facegate_process_request*_total{pid}`` tell how evenly the front-ends share the work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from prometheus_client import generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from facegate.metrics.stats import ServiceStats, family_name

#: The environment variable prometheus_client's multiprocess mode reads.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_multiproc_dir: str | None = None

try:  # prometheus_client >= 0.22 names the classic text format explicitly
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE
except ImportError:  # pragma: no cover - older clients: LATEST *is* the 0.0.4 text format
    from prometheus_client.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE


def enable_multiprocess() -> None:
    """Keep this process's metrics in ``$PROMETHEUS_MULTIPROC_DIR`` if it is a folder (call before ServiceStats)."""
    global _multiproc_dir
    path = os.environ.get(MULTIPROC_ENV)
    if path and os.path.isdir(path):
        values.ValueClass = values.MultiProcessValue()
        _multiproc_dir = path


def process_exited(pid: int) -> None:
    """Bookkeeping for a front-end that exited (its counters stay: they are part of the server's totals)."""
    path = _multiproc_dir or os.environ.get(MULTIPROC_ENV)
    if path:
        mark_process_dead(pid, path)


class _Collector(Collector):
    """``stats``'s families, with the engine's ``remote`` ones in place of this process's; with a ``shared`` folder,
    only this process's gauges, then every process's counters and histograms summed from it (engine families left
    out)."""

    def __init__(
        self, stats: ServiceStats, remote: dict[str, Metric], shared: str | None, gallery_labels: bool
    ) -> None:
        self.stats, self.remote, self.shared, self.gallery_labels = stats, remote, shared, gallery_labels

    def collect(self) -> Iterator[Metric]:
        self.stats.refresh_gpu_memory()
        for metric in self.stats.registry.collect():
            name = family_name(metric)
            if name in self.remote:
                metric = self.remote[name]
            elif self.shared and metric.type != "gauge":
                continue
            if name == "facegate_gallery_subjects" and not self.gallery_labels:
                metric = GaugeMetricFamily(name, metric.documentation, sum(s.value for s in metric.samples))
            yield metric
        if not self.shared:
            return
        # this front-end's own requests (scrapes excluded) and their in-server seconds
        own = [s for s in self.stats.request_latency.collect()[0].samples if "/metrics" not in s.labels["route"]]
        for name, what, sample in (
            ("facegate_process_requests", "Requests", "_count"),
            ("facegate_process_request_seconds", "In-server seconds of the requests", "_sum"),
        ):
            family = CounterMetricFamily(
                name, f"{what} this front-end process answered (scrapes excluded).", labels=["pid"]
            )
            family.add_metric([str(os.getpid())], sum((s.value for s in own if s.name.endswith(sample)), 0.0))
            yield family
        for metric in MultiProcessCollector(None, self.shared).collect():
            if metric.type != "gauge" and family_name(metric) not in self.remote:
                yield metric


def render_latest(
    stats: ServiceStats, remote: Sequence[Metric] | None = None, *, gallery_labels: bool = True
) -> tuple[bytes, str]:
    """The text exposition of ``stats`` (``text/plain; version=0.0.4``) with the engine's ``remote`` families
    (:meth:`ServiceStats.engine_samples`); without ``gallery_labels``, ``facegate_gallery_subjects`` is one unlabelled
    total."""
    remote_by_name = {family_name(m): m for m in remote or ()}
    shared = _multiproc_dir if _multiproc_dir is not None and os.path.isdir(_multiproc_dir) else None
    return generate_latest(_Collector(stats, remote_by_name, shared, gallery_labels)), CONTENT_TYPE
