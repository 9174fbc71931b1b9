"""Plain, thread-safe service statistics: counters, gauges and fixed-bucket histograms.

This module deliberately does **not** import ``prometheus_client``: the engine, pipeline and routes record
here, and :mod:`facegate.metrics.prometheus` (the only exporter) reads these objects at scrape time.
Metric families are named with their final Prometheus names (``facegate_*``).

Usage::

    stats = ServiceStats()
    stats.record_request("/api/compare", 200, 0.012)
    stats.items.labels("embed").inc(64)
    stats.mean_batch_size("embed")
    json.dumps(stats.snapshot())
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from facegate.errors import FacegateError

log = logging.getLogger(__name__)

LabelValues = tuple[str, ...]

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

#: The engine's phases per batch.
PHASES: tuple[str, ...] = ("prepare", "execute", "deliver")
#: Why an item was dropped before compute.
DROP_REASONS: tuple[str, ...] = ("expired", "cancelled")


class SharedValue(Protocol):
    """A value other processes can read (a prometheus_client multiprocess value)."""

    def inc(self, amount: float) -> None: ...


#: ``factory(kind, family, sample name, label names, label values, doc)`` → a :class:`SharedValue`.
SharedValueFactory = Callable[[str, str, str, LabelValues, LabelValues, str], SharedValue]
_shared_factory: SharedValueFactory | None = None


def share_values(factory: SharedValueFactory | None) -> None:
    """Also write every counter and histogram series created from now on in this process through ``factory``.

    Several front-end processes answer one port; each records its own requests. With a factory from
    :func:`facegate.metrics.prometheus.enable_multiprocess` their series are summed at every scrape, so any
    front-end's ``/metrics`` shows the whole server. Gauges stay per process (the gallery sizes each
    front-end reads from the shared store are already the whole server's). ``None``: process-local only.
    """
    global _shared_factory
    _shared_factory = factory


def _check_labels(names: LabelValues, values: Sequence[object]) -> LabelValues:
    if len(values) != len(names):
        raise FacegateError(f"expected label values for {names}, got {tuple(values)}")
    return tuple(str(v) for v in values)


# --------------------------------------------------------------------------- children (one series)
class CounterChild:
    """One counter series. Monotonic; thread-safe.

    ``shared``: where the increments also go (see :func:`share_values`).
    """

    __slots__ = ("_lock", "_shared", "_value")

    def __init__(self, shared: SharedValue | None = None) -> None:
        self._lock = threading.Lock()
        self._value = 0.0
        self._shared = shared

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0)."""
        if amount < 0:
            raise FacegateError(f"a counter cannot decrease (amount={amount})")
        with self._lock:
            self._value += amount
        if self._shared is not None:
            self._shared.inc(amount)

    def get(self) -> float:
        """Current value."""
        return self._value


class GaugeChild:
    """One gauge series. Thread-safe."""

    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def set(self, value: float) -> None:
        """Set to ``value``."""
        self._value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount``."""
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        """Subtract ``amount``."""
        with self._lock:
            self._value -= amount

    def get(self) -> float:
        """Current value."""
        return self._value


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A consistent copy of one histogram series.

    Attributes:
        bounds: finite upper bounds (``le``), ascending.
        counts: observations per bucket, **not** cumulative; ``len(bounds) + 1`` entries, the last being
            the ``+Inf`` overflow bucket.
        sum: sum of all observed values.
        count: number of observations (``sum(counts)``).
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """``[(le, cumulative count), ...]`` ending with ``(inf, count)``, Prometheus-style."""
        out: list[tuple[float, int]] = []
        acc = 0
        for le, c in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += c
            out.append((le, acc))
        return out

    @property
    def mean(self) -> float | None:
        """Mean observation, ``None`` when empty."""
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Bucket-interpolated estimate of the ``q``-quantile (like PromQL ``histogram_quantile``).

        Linear within the bucket (lower edge 0 for the first bucket); a quantile falling into the
        ``+Inf`` bucket returns the largest finite bound. ``None`` when empty.
        """
        if not self.count:
            return None
        rank = min(max(q, 0.0), 1.0) * self.count
        acc = 0
        lower = 0.0
        for i, c in enumerate(self.counts):
            if i == len(self.bounds):
                return self.bounds[-1] if self.bounds else None
            upper = self.bounds[i]
            if c and acc + c >= rank:
                return lower + (upper - lower) * ((rank - acc) / c)
            acc += c
            lower = upper
        return self.bounds[-1] if self.bounds else None  # pragma: no cover - loop always returns

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: count, sum, mean, p50/p90/p99 estimates, cumulative buckets."""

        def rnd(v: float | None) -> float | None:
            return None if v is None else round(v, 6)

        return {
            "count": self.count,
            "sum": round(self.sum, 6),
            "mean": rnd(self.mean),
            "p50": rnd(self.quantile(0.5)),
            "p90": rnd(self.quantile(0.9)),
            "p99": rnd(self.quantile(0.99)),
            "buckets": {("+Inf" if math.isinf(le) else repr(le)): c for le, c in self.cumulative()},
        }


class HistogramChild:
    """One histogram series with fixed buckets. Thread-safe.

    ``shared``: one value per bucket (the last is ``+Inf``) and one for the sum, where observations also go
    (see :func:`share_values`).
    """

    __slots__ = ("_bounds", "_count", "_counts", "_lock", "_shared", "_sum")

    def __init__(self, bounds: tuple[float, ...], shared: tuple[list[SharedValue], SharedValue] | None = None) -> None:
        self._bounds = bounds
        self._lock = threading.Lock()
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._count = 0
        self._shared = shared

    def observe(self, value: float) -> None:
        """Record one observation (``value <= le`` falls into bucket ``le``)."""
        i = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value
            self._count += 1
        if self._shared is not None:
            self._shared[0][i].inc(1.0)
            self._shared[1].inc(value)

    def observe_many(self, values: Sequence[float]) -> None:
        """Record several observations under one lock acquisition."""
        idx = [bisect.bisect_left(self._bounds, v) for v in values]
        total = float(sum(values))
        with self._lock:
            for i in idx:
                self._counts[i] += 1
            self._sum += total
            self._count += len(idx)
        if self._shared is not None:
            for i in idx:
                self._shared[0][i].inc(1.0)
            self._shared[1].inc(total)

    def snapshot(self) -> HistogramSnapshot:
        """A consistent copy."""
        with self._lock:
            return HistogramSnapshot(self._bounds, tuple(self._counts), self._sum, self._count)


C = TypeVar("C", CounterChild, GaugeChild, HistogramChild)


# --------------------------------------------------------------------------- families (labelled)
class _Family(Generic[C]):
    kind: ClassVar[str] = ""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labelnames: LabelValues = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[LabelValues, C] = {}

    def _new_child(self, key: LabelValues) -> C:  # pragma: no cover - abstract
        raise NotImplementedError

    def labels(self, *values: object) -> C:
        """The series for these label values (created on first use; cache it on hot paths)."""
        key = _check_labels(self.labelnames, values)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.get(key)
                if child is None:
                    child = self._new_child(key)
                    self._children[key] = child
        return child

    def remove(self, *values: object) -> None:
        """Forget one series (e.g. a deleted gallery); no error if absent."""
        key = _check_labels(self.labelnames, values)
        with self._lock:
            self._children.pop(key, None)

    def children(self) -> list[tuple[LabelValues, C]]:
        """``(label values, child)`` pairs, sorted by label values."""
        with self._lock:
            return sorted(self._children.items())


S = TypeVar("S", CounterChild, GaugeChild)


class _ScalarFamily(_Family[S]):
    """Shared reads of the single-number families (counters and gauges)."""

    def value(self, *values: object) -> float:
        """Current value of one series (0 when it does not exist)."""
        key = _check_labels(self.labelnames, values)
        child = self._children.get(key)
        return 0.0 if child is None else child.get()

    def samples(self) -> list[tuple[LabelValues, float]]:
        """``(label values, value)`` for every series."""
        return [(k, c.get()) for k, c in self.children()]


class Counter(_ScalarFamily[CounterChild]):
    """A labelled counter family. Unlabelled families can call :meth:`inc` directly."""

    kind = "counter"

    def _new_child(self, key: LabelValues) -> CounterChild:
        if _shared_factory is None:
            return CounterChild()
        base = self.name.removesuffix("_total")  # prometheus_client names a counter without its sample suffix
        return CounterChild(_shared_factory("counter", base, self.name, self.labelnames, key, self.doc))

    def inc(self, amount: float = 1.0) -> None:
        """Unlabelled shortcut for ``labels().inc(amount)``."""
        self.labels().inc(amount)


class Gauge(_ScalarFamily[GaugeChild]):
    """A labelled gauge family."""

    kind = "gauge"

    def _new_child(self, key: LabelValues) -> GaugeChild:
        return GaugeChild()

    def set(self, value: float) -> None:
        """Unlabelled shortcut for ``labels().set(value)``."""
        self.labels().set(value)


class Histogram(_Family[HistogramChild]):
    """A labelled histogram family with fixed bucket bounds."""

    kind = "histogram"

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float]) -> None:
        super().__init__(name, doc, labelnames)
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise FacegateError(f"histogram {name}: buckets must be strictly increasing, got {tuple(buckets)}")
        self.bounds = bounds

    def _new_child(self, key: LabelValues) -> HistogramChild:
        f = _shared_factory
        if f is None:
            return HistogramChild(self.bounds)
        les = (*(repr(float(b)) for b in self.bounds), "+Inf")
        names = (*self.labelnames, "le")
        buckets = [f("histogram", self.name, f"{self.name}_bucket", names, (*key, le), self.doc) for le in les]
        total = f("histogram", self.name, f"{self.name}_sum", self.labelnames, key, self.doc)
        return HistogramChild(self.bounds, (buckets, total))

    def observe(self, value: float) -> None:
        """Unlabelled shortcut for ``labels().observe(value)``."""
        self.labels().observe(value)

    def snapshot(self, *values: object) -> HistogramSnapshot:
        """Copy of one series (empty when it does not exist)."""
        key = _check_labels(self.labelnames, values)
        child = self._children.get(key)
        if child is None:
            return HistogramSnapshot(self.bounds, (0,) * (len(self.bounds) + 1), 0.0, 0)
        return child.snapshot()

    def samples(self) -> list[tuple[LabelValues, HistogramSnapshot]]:
        """``(label values, snapshot)`` for every series."""
        return [(k, c.snapshot()) for k, c in self.children()]


Family = Counter | Gauge | Histogram
GpuMemoryFn = Callable[[], Mapping[str, float]]


# --------------------------------------------------------------------------- the holder
class ServiceStats:
    """Every statistic facegate keeps, in one thread-safe holder.

    Families (Prometheus names): ``requests`` (facegate_requests_total{route,status}), ``request_latency``
    (facegate_request_latency_seconds{route}), ``queue_depth`` (facegate_queue_depth{stage}),
    ``queue_wait`` (facegate_queue_wait_seconds{stage}), ``batch_size`` (facegate_batch_size{stage}),
    ``compute_seconds`` (facegate_compute_seconds{stage,phase}), ``items``
    (facegate_items_total{stage}; rows that went through ``execute``: items, or the stage's ``item_cost``), ``dropped``
    (facegate_dropped_total{stage,reason}), ``stage_errors`` (facegate_stage_errors_total{stage,phase};
    items that got a stage exception), ``quality_score`` (facegate_quality_score), ``refusals``
    (facegate_refusals_total{reason}), ``gallery_subjects`` (facegate_gallery_subjects{gallery}),
    ``gpu_memory`` (facegate_gpu_memory_bytes{kind}: allocated, reserved, peak), ``process``
    (facegate_process_info{pid}: which process answered the scrape).

    Args:
        gpu_memory_fn: optional callable returning ``{"allocated": bytes, "reserved": bytes, "peak": bytes}``;
            called by :meth:`refresh_gpu_memory` (at every scrape and snapshot). See :func:`torch_cuda_memory_fn`.
    """

    GPU_MEMORY_KINDS: ClassVar[tuple[str, ...]] = ("allocated", "reserved", "peak")

    def __init__(self, *, gpu_memory_fn: GpuMemoryFn | None = None) -> None:
        self.started_at = time.time()
        self.requests = Counter("facegate_requests_total", "HTTP requests by route and status.", ("route", "status"))
        self.request_latency = Histogram(
            "facegate_request_latency_seconds", "HTTP request latency.", ("route",), buckets=LATENCY_BUCKETS
        )
        self.engine_call = Histogram(
            "facegate_engine_call_seconds",
            "From the service submitting an item to an engine stage to its answer (queue, compute and, with "
            "engine processes, the transport both ways).",
            ("stage",),
            buckets=LATENCY_BUCKETS,
        )
        self.queue_depth = Gauge("facegate_queue_depth", "Items waiting in a stage queue.", ("stage",))
        self.queue_wait = Histogram(
            "facegate_queue_wait_seconds",
            "Time from enqueue to batch formation.",
            ("stage",),
            buckets=QUEUE_WAIT_BUCKETS,
        )
        self.batch_size = Histogram(
            "facegate_batch_size",
            "Rows per executed batch (items, or the stage's item_cost).",
            ("stage",),
            buckets=BATCH_BUCKETS,
        )
        self.compute_seconds = Histogram(
            "facegate_compute_seconds", "Per-batch time of one phase.", ("stage", "phase"), buckets=COMPUTE_BUCKETS
        )
        self.items = Counter(
            "facegate_items_total", "Rows executed by a stage (items, or item_cost; rate = images/s).", ("stage",)
        )
        self.dropped = Counter("facegate_dropped_total", "Items dropped before compute.", ("stage", "reason"))
        self.stage_errors = Counter(
            "facegate_stage_errors_total", "Items that received a stage exception.", ("stage", "phase")
        )
        self.quality_score = Histogram(
            "facegate_quality_score", "Calibrated quality score of scored faces.", (), buckets=QUALITY_BUCKETS
        )
        self.refusals = Counter("facegate_refusals_total", "Quality-gate refusals by reason.", ("reason",))
        self.gallery_subjects = Gauge("facegate_gallery_subjects", "Subjects enrolled per gallery.", ("gallery",))
        self.gallery_feed_lag = Histogram(
            "facegate_gallery_feed_lag_seconds",
            "Seconds from a gallery change's commit in the store to its application in this process's index.",
            (),
            buckets=QUEUE_WAIT_BUCKETS,
        )
        self.gpu_memory = Gauge("facegate_gpu_memory_bytes", "GPU memory of this process.", ("kind",))
        self.process = Gauge(
            "facegate_process_info",
            "1, labelled with the id of the process that answered this scrape (several front-end processes share "
            "one port: a scraper tells their counters apart by it).",
            ("pid",),
        )
        self.process.labels(str(os.getpid())).set(1.0)
        self._gpu_memory_fn: GpuMemoryFn | None = gpu_memory_fn
        self._stages: list[str] = []
        self._stages_lock = threading.Lock()

    # ------------------------------------------------------------------ registry of families
    def families(self) -> list[Family]:
        """Every metric family, in exposition order."""
        return [
            self.requests,
            self.request_latency,
            self.engine_call,
            self.queue_depth,
            self.queue_wait,
            self.batch_size,
            self.compute_seconds,
            self.items,
            self.dropped,
            self.stage_errors,
            self.quality_score,
            self.refusals,
            self.gallery_subjects,
            self.gallery_feed_lag,
            self.gpu_memory,
            self.process,
        ]

    #: Families the engine records (queues, batches, compute, GPU memory): in the process model they live in
    #: the engine process, and front-ends export the engine's copy (:meth:`engine_samples`).
    ENGINE_FAMILIES: ClassVar[tuple[str, ...]] = (
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

    def engine_samples(self) -> dict[str, list[tuple[LabelValues, Any]]]:
        """``{family name: samples}`` of :attr:`ENGINE_FAMILIES` (picklable; GPU memory refreshed first)."""
        self.refresh_gpu_memory()
        return {f.name: f.samples() for f in self.families() if f.name in self.ENGINE_FAMILIES}

    @staticmethod
    def merge_samples(parts: Sequence[Mapping[str, list[tuple[LabelValues, Any]]]]) -> dict[str, list[Any]]:
        """Sum several engines' :meth:`engine_samples` series by series (counters, gauges and histogram
        buckets add up; the result is what one engine serving all of their work would show)."""
        out: dict[str, dict[LabelValues, Any]] = {}
        for part in parts:
            for name, samples in part.items():
                fam = out.setdefault(name, {})
                for labels, v in samples:
                    key = tuple(labels)
                    if key not in fam:
                        fam[key] = v
                    elif isinstance(v, HistogramSnapshot):
                        a = fam[key]
                        counts = tuple(x + y for x, y in zip(a.counts, v.counts, strict=True))
                        fam[key] = HistogramSnapshot(a.bounds, counts, a.sum + v.sum, a.count + v.count)
                    else:
                        fam[key] = fam[key] + v
        return {name: list(series.items()) for name, series in out.items()}

    def register_stage(self, stage: str) -> None:
        """Create a stage's series at zero so dashboards see them before the first batch."""
        with self._stages_lock:
            if stage not in self._stages:
                self._stages.append(stage)
        self.queue_depth.labels(stage)
        self.queue_wait.labels(stage)
        self.batch_size.labels(stage)
        self.items.labels(stage)
        for phase in PHASES:
            self.compute_seconds.labels(stage, phase)
        for reason in DROP_REASONS:
            self.dropped.labels(stage, reason)

    @property
    def stages(self) -> list[str]:
        """Registered stage names, in registration order."""
        with self._stages_lock:
            return list(self._stages)

    # ------------------------------------------------------------------ convenience recorders
    def record_request(self, route: str, status: int | str, latency_s: float) -> None:
        """One finished HTTP request (route template, status code, seconds)."""
        self.requests.labels(route, status).inc()
        self.request_latency.labels(route).observe(latency_s)

    def record_batch(
        self, stage: str, size: int, *, prepare_s: float, execute_s: float, deliver_s: float = 0.0
    ) -> None:
        """One executed batch of ``size`` items and its per-phase seconds."""
        self.batch_size.labels(stage).observe(size)
        self.items.labels(stage).inc(size)
        self.compute_seconds.labels(stage, "prepare").observe(prepare_s)
        self.compute_seconds.labels(stage, "execute").observe(execute_s)
        self.compute_seconds.labels(stage, "deliver").observe(deliver_s)

    def record_quality(self, score: float) -> None:
        """One calibrated quality score in [0, 1]."""
        self.quality_score.observe(score)

    observe_quality = record_quality  #: alias used by :class:`facegate.service.faces.FaceService`

    def record_refusal(self, reason: str) -> None:
        """One quality-gate refusal (use a short, bounded vocabulary of reasons)."""
        self.refusals.labels(reason).inc()

    def set_gallery_size(self, gallery: str, subjects: int) -> None:
        """Current number of subjects in a gallery."""
        self.gallery_subjects.labels(gallery).set(subjects)

    def gallery_sizes_hook(self) -> Callable[[dict[str, int]], None]:
        """A hook for :class:`~facegate.gallery.service.Gallery` that mirrors ``{gallery: size}`` into
        ``facegate_gallery_subjects`` (forgetting galleries that disappeared)."""
        known: set[str] = set()

        def hook(sizes: dict[str, int]) -> None:
            for name in known - set(sizes):
                self.remove_gallery(name)
            for name, n in sizes.items():
                self.set_gallery_size(name, n)
            known.clear()
            known.update(sizes)

        return hook

    def observe_feed_lag(self, lag_s: float, changes: int) -> None:
        """A batch of ``changes`` gallery changes applied ``lag_s`` seconds after the newest one committed."""
        del changes  # the lag of a batch is its newest change's
        self.gallery_feed_lag.observe(lag_s)

    def remove_gallery(self, gallery: str) -> None:
        """Forget a deleted gallery's series."""
        self.gallery_subjects.remove(gallery)

    # ------------------------------------------------------------------ derived values
    def mean_batch_size(self, stage: str) -> float:
        """Mean items per executed batch of ``stage``; ``0.0`` before its first batch."""
        snap = self.batch_size.snapshot(stage)
        return snap.sum / snap.count if snap.count else 0.0

    def set_gpu_memory_source(self, fn: GpuMemoryFn | None) -> None:
        """Install (or remove) the callable that :meth:`refresh_gpu_memory` reads."""
        self._gpu_memory_fn = fn

    def refresh_gpu_memory(self) -> dict[str, float]:
        """Call the GPU-memory source and update the gauges; ``{}`` without one or when it fails."""
        fn = self._gpu_memory_fn
        if fn is None:
            return {}
        try:
            values = {str(k): float(v) for k, v in fn().items()}
        except Exception:  # a metrics read must never break a scrape
            log.warning("gpu memory source failed", exc_info=True)
            return {}
        for kind, v in values.items():
            self.gpu_memory.labels(kind).set(v)
        return values

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able view of everything (GPU memory refreshed first).

        Shape: ``{"uptime_s", "requests": {route: {"by_status": {status: n}, "latency_s": hist}},
        "stages": {stage: {"queue_depth", "items_total", "batches_total", "mean_batch_size",
        "dropped": {reason: n}, "errors": {phase: n}, "batch_size": hist, "queue_wait_s": hist,
        "compute_s": {phase: hist}}}, "quality_score": hist, "refusals": {reason: n},
        "galleries": {name: subjects}, "gpu_memory_bytes": {kind: bytes}}`` where ``hist`` is
        :meth:`HistogramSnapshot.to_dict`.
        """
        self.refresh_gpu_memory()
        requests: dict[str, Any] = {}
        for (route, status), v in self.requests.samples():
            requests.setdefault(route, {"by_status": {}, "latency_s": None})["by_status"][status] = v
        for (route,), h in self.request_latency.samples():
            requests.setdefault(route, {"by_status": {}, "latency_s": None})["latency_s"] = h.to_dict()

        names = self.stages
        for labels, _ in self.batch_size.samples():
            if labels[0] not in names:
                names.append(labels[0])
        stages: dict[str, Any] = {}
        for st in names:
            bs = self.batch_size.snapshot(st)
            stages[st] = {
                "queue_depth": self.queue_depth.value(st),
                "items_total": self.items.value(st),
                "batches_total": bs.count,
                "mean_batch_size": round(self.mean_batch_size(st), 4),
                "dropped": {r: self.dropped.value(st, r) for r in DROP_REASONS},
                "errors": {p: self.stage_errors.value(st, p) for p in PHASES},
                "batch_size": bs.to_dict(),
                "queue_wait_s": self.queue_wait.snapshot(st).to_dict(),
                "compute_s": {p: self.compute_seconds.snapshot(st, p).to_dict() for p in PHASES},
            }
        return {
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests": requests,
            "stages": stages,
            "quality_score": self.quality_score.snapshot().to_dict(),
            "refusals": {r: v for (r,), v in self.refusals.samples()},
            "galleries": {g: v for (g,), v in self.gallery_subjects.samples()},
            "gpu_memory_bytes": {k: v for (k,), v in self.gpu_memory.samples()},
        }


def torch_cuda_memory_fn(device: int | str | None = None) -> GpuMemoryFn:
    """A GPU-memory source for :class:`ServiceStats` reading ``torch.cuda`` (imported lazily).

    Returns a callable giving ``{"allocated", "reserved", "peak"}`` bytes for ``device`` (current CUDA
    device by default), or ``{}`` when CUDA is unavailable.
    """

    def read() -> dict[str, float]:
        import torch

        if not torch.cuda.is_available():
            return {}
        return {
            "allocated": float(torch.cuda.memory_allocated(device)),
            "reserved": float(torch.cuda.memory_reserved(device)),
            "peak": float(torch.cuda.max_memory_allocated(device)),
        }

    return read
