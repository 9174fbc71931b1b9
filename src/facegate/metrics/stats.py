"""Service statistics: prometheus_client families in a private registry per :class:`ServiceStats`, so any number of
holders (engines, tests) coexist in one process; :mod:`facegate.metrics.prometheus` exports them.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)
disable_created_metrics()  # the exposition carries no ``*_created`` series

GpuMemoryFn = Callable[[], Mapping[str, float]]
M = TypeVar("M", Counter, Gauge, Histogram)

#: Request latency, seconds.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
#: Time spent waiting in a stage queue, seconds.
QUEUE_WAIT_BUCKETS: tuple[float, ...] = (
    0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Per-batch compute time of one phase (prepare / execute / deliver), seconds.
COMPUTE_BUCKETS: tuple[float, ...] = (
    0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
#: Batch sizes: powers of two up to 4096 (the largest allowed ``max_batch_size``).
BATCH_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(13))
#: Calibrated quality score in [0, 1].
QUALITY_BUCKETS: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 21))

#: Families the engine records: in the process model they live in the engine process, and front-ends export
#: the engine's copy (:meth:`ServiceStats.engine_samples`).
ENGINE_FAMILIES: tuple[str, ...] = (
    "facegate_queue_depth",
    "facegate_queue_wait_seconds",
    "facegate_batch_size",
    "facegate_compute_seconds",
    "facegate_items_total",
    "facegate_dropped_total",
    "facegate_stage_errors_total",
    "facegate_gpu_memory_bytes",
    "facegate_gallery_feed_lag_seconds",
    "facegate_gallery_subjects",  # the engine's index, kept current by the store's change feed
)


def family_name(metric: Metric) -> str:
    """The name a collected family is written under (prometheus_client drops a counter's ``_total``)."""
    return metric.name + "_total" if metric.type == "counter" else metric.name


class ServiceStats:
    """Every statistic facegate keeps, one family per attribute; ``gpu_memory_fn`` returns ``{"allocated",
    "reserved", "peak"}`` bytes at every scrape (:func:`torch_cuda_memory_fn`); it may be replaced any time."""

    def __init__(self, *, gpu_memory_fn: GpuMemoryFn | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        fam = self._family
        self.requests = fam(Counter, "facegate_requests_total", "HTTP requests by route and status.", "route", "status")
        self.request_latency = fam(
            Histogram, "facegate_request_latency_seconds", "HTTP request latency.", "route", buckets=LATENCY_BUCKETS
        )
        self.engine_call = fam(
            Histogram,
            "facegate_engine_call_seconds",
            "From the service submitting an item to an engine stage to its answer (queue, compute and, with "
            "engine processes, the transport both ways).",
            "stage",
            buckets=LATENCY_BUCKETS,
        )
        self.queue_depth = fam(Gauge, "facegate_queue_depth", "Items waiting in a stage queue.", "stage")
        self.queue_wait = fam(
            Histogram,
            "facegate_queue_wait_seconds",
            "Time from enqueue to batch formation.",
            "stage",
            buckets=QUEUE_WAIT_BUCKETS,
        )
        self.batch_size = fam(
            Histogram,
            "facegate_batch_size",
            "Rows per executed batch (items, or the stage's item_cost).",
            "stage",
            buckets=BATCH_BUCKETS,
        )
        self.compute_seconds = fam(
            Histogram,
            "facegate_compute_seconds",
            "Per-batch time of one phase.",
            "stage",
            "phase",
            buckets=COMPUTE_BUCKETS,
        )
        self.items = fam(
            Counter, "facegate_items_total", "Rows executed by a stage (items, or item_cost; rate = images/s).", "stage"
        )
        self.dropped = fam(Counter, "facegate_dropped_total", "Items dropped before compute.", "stage", "reason")
        self.stage_errors = fam(
            Counter, "facegate_stage_errors_total", "Items that received a stage exception.", "stage", "phase"
        )
        self.quality_score = fam(
            Histogram, "facegate_quality_score", "Calibrated quality score of scored faces.", buckets=QUALITY_BUCKETS
        )
        self.refusals = fam(Counter, "facegate_refusals_total", "Quality-gate refusals by reason.", "reason")
        self.gallery_subjects = fam(Gauge, "facegate_gallery_subjects", "Subjects enrolled per gallery.", "gallery")
        self.gallery_feed_lag = fam(
            Histogram,
            "facegate_gallery_feed_lag_seconds",
            "Seconds from a gallery change's commit in the store to its application in this process's index.",
            buckets=QUEUE_WAIT_BUCKETS,
        )
        self.gpu_memory = fam(Gauge, "facegate_gpu_memory_bytes", "GPU memory of this process.", "kind")
        self.process = fam(
            Gauge,
            "facegate_process_info",
            "1, labelled with the id of the process that answered this scrape (several front-end processes share "
            "one port: a scraper tells their counters apart by it).",
            "pid",
        )
        self.process.labels(str(os.getpid())).set(1.0)
        self.gpu_memory_fn = gpu_memory_fn

    def _family(self, kind: type[M], name: str, doc: str, *labels: str, **kw: Any) -> M:
        return kind(name, doc, labels, registry=self.registry, **kw)

    def value(self, sample: str, **labels: str) -> float:
        """One sample's current value (``facegate_items_total``, ``facegate_batch_size_count``, ...); 0 if absent."""
        return self.registry.get_sample_value(sample, labels) or 0.0

    def engine_samples(self) -> list[Metric]:
        """The collected families of :data:`ENGINE_FAMILIES` (GPU memory refreshed first), picklable, for a
        front-end."""
        self.refresh_gpu_memory()
        return [m for m in self.registry.collect() if family_name(m) in ENGINE_FAMILIES]

    @staticmethod
    def merge_samples(parts: Sequence[Sequence[Metric]]) -> list[Metric]:
        """Several engines' :meth:`engine_samples`, each sample summed over them (what one engine doing all their
        work would show)."""
        families: dict[str, Metric] = {}
        sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for metric in (m for part in parts for m in part):
            families.setdefault(metric.name, metric)
            into = sums.setdefault(metric.name, {})
            # every engine holds the whole gallery index: its size is not summed over them
            combine = max if metric.name == "facegate_gallery_subjects" else operator.add
            for s in metric.samples:
                key = (s.name, tuple(s.labels.items()))
                into[key] = combine(into.get(key, 0.0), s.value)
        for name, metric in families.items():
            metric.samples = [Sample(n, dict(labels), v) for (n, labels), v in sums[name].items()]
        return list(families.values())

    def register_stage(self, stage: str) -> None:
        """Create a stage's series at zero so dashboards see them before the first batch."""
        for family in (self.queue_depth, self.queue_wait, self.batch_size, self.items):
            family.labels(stage)
        for phase in ("prepare", "execute", "deliver"):  # the engine's phases per batch
            self.compute_seconds.labels(stage, phase)
        for reason in ("expired", "cancelled"):  # why an item is dropped before compute
            self.dropped.labels(stage, reason)

    def record_request(self, route: str, status: int | str, latency_s: float) -> None:
        """One finished HTTP request (route template, status code, seconds)."""
        self.requests.labels(route, status).inc()
        self.request_latency.labels(route).observe(latency_s)

    def gallery_sizes_hook(self) -> Callable[[dict[str, int]], None]:
        """A hook for :class:`~facegate.pipeline.search.Gallery` that mirrors ``{gallery: size}`` into
        ``facegate_gallery_subjects`` (forgetting galleries that disappeared)."""
        known: set[str] = set()

        def hook(sizes: dict[str, int]) -> None:
            for name in known - set(sizes):
                self.gallery_subjects.remove(name)
            for name, n in sizes.items():
                self.gallery_subjects.labels(name).set(n)
            known.clear()
            known.update(sizes)

        return hook

    def refresh_gpu_memory(self) -> None:
        """Call the GPU-memory source and update the gauges (they keep their values when it fails)."""
        if self.gpu_memory_fn is None:
            return
        try:
            values = {str(k): float(v) for k, v in self.gpu_memory_fn().items()}
        except Exception:  # a metrics read must never break a scrape
            log.warning("gpu memory source failed", exc_info=True)
            return
        for kind, v in values.items():
            self.gpu_memory.labels(kind).set(v)


def torch_cuda_memory_fn(device: int | str | None = None) -> GpuMemoryFn:
    """A GPU-memory source reading ``torch.cuda`` (imported lazily) for a CUDA engine's ``device``."""

    def read() -> dict[str, float]:
        import torch

        return {
            "allocated": float(torch.cuda.memory_allocated(device)),
            "reserved": float(torch.cuda.memory_reserved(device)),
            "peak": float(torch.cuda.max_memory_allocated(device)),
        }

    return read
