"""Model-agnostic inference engine: cross-request dynamic batching over pluggable :class:`Stage` objects.

Per stage a front thread collects batch k+1 (up to ``max_batch_size`` items, or rows with ``item_cost``, or until
``max_wait_ms`` after the first) and prepares it while the one :class:`DeviceThread` runs execute + deliver of
batch k: only ``execute`` touches the GPU, and one thread holds one set of cuDNN/cuBLAS handles. At most one
prepared batch waits, so batches form as late as possible. A stage exception fails only its
batch (non-FacegateErrors as :class:`EngineError`); an exception among its results fails only that item.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from facegate.engine.batcher import AnyFuture, Batcher, WorkItem, fail, settle
from facegate.errors import DeadlineExceededError, EngineClosedError, EngineError, FacegateError, InvalidParameterError
from facegate.metrics.stats import ServiceStats

log = logging.getLogger(__name__)

_STOP = object()


class Stage(Protocol):
    """One batched computation: ``name`` (the metrics' ``stage`` label), optionally ``item_cost(payload) -> int``
    (rows one payload adds; batches are then limited by rows) and ``deliver(result, n) -> list``, the ``n`` per-item
    results in input order from what ``execute`` returned (without it, ``execute`` returns that list).

    ``prepare`` of batch k+1 runs while ``execute`` of batch k does: shared mutable buffers need two copies.
    """

    name: str

    def prepare(self, payloads: list[Any]) -> Any:
        """Host-side batching of ``len(payloads) >= 1`` payloads."""

    def execute(self, prepared: Any) -> Any:
        """Device compute on what :meth:`prepare` returned; returns host-side results."""


def as_facegate_error(exc: BaseException, stage: str, phase: str) -> FacegateError:
    """A stage exception as it is delivered: FacegateErrors unchanged, others wrapped in EngineError."""
    if isinstance(exc, FacegateError):
        return exc
    err = EngineError(
        f"stage {stage!r} failed in {phase}: {type(exc).__name__}: {exc}",
        detail={"stage": stage, "phase": phase, "type": type(exc).__name__},
    )
    err.__cause__ = exc
    return err


def _join(thread: threading.Thread, deadline: float | None) -> bool:
    """Wait for ``thread`` until ``deadline`` (``time.monotonic()``; None: forever); whether it ended."""
    thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not thread.is_alive()


class DeviceThread(concurrent.futures.Executor):
    """``threads`` worker threads starting what is submitted in order (one on CUDA: one set of library handles; on the
    CPU one per core, so that batches of the stages run at once); after :meth:`shutdown` a submit raises
    EngineClosedError (what was queued still runs)."""

    def __init__(self, threads: int = 1) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        name = "facegate-device"
        self._threads = [threading.Thread(target=self._loop, name=name, daemon=True) for _ in range(threads)]
        self._thread = self._threads[0]
        self._lock = threading.Lock()
        self._closed = False
        self._busy = 0  # submitted and not finished

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine's device thread was shut down")
            if self._thread.ident is None:  # not started yet
                for t in self._threads:
                    t.start()
            self._queue.put((fut, fn, args, kwargs))
            self._busy += 1
        return fut

    def _loop(self) -> None:
        while (msg := self._queue.get()) is not _STOP:
            fut, fn, args, kwargs = msg
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    fut.set_exception(exc)
            with self._lock:
                self._busy -= 1

    def idle(self) -> bool:
        """Whether a thread is free: fewer tasks submitted and not finished than threads."""
        return self._busy < len(self._threads)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; queued work still runs (``cancel_futures`` is ignored)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._thread.ident is not None:
                    for _ in self._threads:
                        self._queue.put(_STOP)
        if wait:
            self.join(None)

    def join(self, deadline: float | None) -> bool:
        return self._thread.ident is None or all([_join(t, deadline) for t in self._threads])

    def alive(self) -> bool:
        """Not started yet, or running."""
        return self._thread.ident is None or all(t.is_alive() for t in self._threads)


class _StageRunner:
    """The front thread and queue of one stage; the engine's :class:`DeviceThread` runs its execute phase."""

    def __init__(self, stage: Stage, engine: Engine, max_queue: int) -> None:
        self.stage = stage
        self._device = engine.device_executor
        self.name: str = stage.name
        self.max_batch = max(1, engine.max_batch_size)
        self.max_wait_s = engine.max_wait_ms / 1000.0
        # CPU (a device thread and a pool thread per core): a batch with a row per core waits for no more while a device
        # thread is free; busy, the wait fills it further (more rows a batch, fewer hand-offs between threads)
        n, dev = len(self._device._threads), self._device
        self.enough = (lambda cost: cost >= n and dev.idle()) if n > 1 else None
        self.item_cost: Any = getattr(stage, "item_cost", None)
        self.deliver: Any = getattr(stage, "deliver", None)
        self.stats = stats = engine.stats
        self.batcher = Batcher(self.name, max_queue=max_queue, stats=stats)
        self._slots = threading.Semaphore(1)  # prepared batches waiting for the device thread
        self.abort = False
        stats.register_stage(self.name)
        self._seconds = {p: stats.compute_seconds.labels(self.name, p) for p in ("prepare", "execute", "deliver")}
        self._h_batch = stats.batch_size.labels(self.name)
        self._c_items = stats.items.labels(self.name)
        self.thread = threading.Thread(target=self._front, name=f"facegate-{self.name}-prepare", daemon=True)

    def cost(self, payload: Any) -> int:
        """The payload's batch cost (the stage's ``item_cost``, else 1); stage errors become EngineError."""
        if self.item_cost is None:
            return 1
        try:
            return max(1, int(self.item_cost(payload)))
        except FacegateError:
            raise
        except Exception as exc:
            raise as_facegate_error(exc, self.name, "item_cost") from exc

    def _front(self) -> None:
        try:
            while True:
                self._slots.acquire()
                items = self.batcher.collect(self.max_batch, self.max_wait_s, self.enough)
                if not items:  # closed and drained
                    break
                t0 = time.perf_counter()
                try:
                    prepared = self.stage.prepare([it.payload for it in items])
                except Exception as exc:
                    self._fail(items, exc, "prepare")
                    self._slots.release()
                    continue
                self._seconds["prepare"].observe(time.perf_counter() - t0)
                self._device.submit(self._dispatch, items, prepared)
        except BaseException:  # pragma: no cover - a bug in the engine itself
            log.exception("stage %s: front thread crashed", self.name)
            raise

    def _dispatch(self, items: list[WorkItem], prepared: Any) -> None:
        """Execute and deliver one prepared batch (on the device thread)."""
        self._slots.release()
        name, n = self.name, len(items)
        try:
            if self.abort:
                fail(items, EngineClosedError("engine stopped before this work was computed", detail={"stage": name}))
                return
            now = time.monotonic()
            dropped = [(it, reason) for it in items if (reason := it.drop_reason(now))]
            if len(dropped) == n:  # everyone left while the batch was prepared: skip the device
                self.batcher.finish_dropped(dropped)
                return
            t0 = time.perf_counter()
            try:
                result = self.stage.execute(prepared)
            except Exception as exc:
                self._fail(items, exc, "execute")
                return
            t1 = time.perf_counter()
            try:
                outs = result if self.deliver is None else self.deliver(result, n)
                if not isinstance(outs, list | tuple) or len(outs) != n:
                    got = len(outs) if isinstance(outs, list | tuple) else type(outs).__name__
                    raise EngineError(f"stage {name!r} deliver returned {got} results for {n} items")
            except Exception as exc:
                self._fail(items, exc, "deliver")
                return
            t2 = time.perf_counter()
            self._seconds["execute"].observe(t1 - t0)
            self._seconds["deliver"].observe(t2 - t1)
            rows = sum(it.cost for it in items)
            self._h_batch.observe(rows)
            self._c_items.inc(rows)
            ok = [not isinstance(out, BaseException) for out in outs]
            if not all(ok):
                self.stats.stage_errors.labels(name, "deliver").inc(ok.count(False))
            settle(
                (it.future, good, out if good else as_facegate_error(out, name, "deliver"))
                for it, good, out in zip(items, ok, outs, strict=True)
            )
        except BaseException:  # pragma: no cover - a bug in the engine itself
            log.exception("stage %s: back thread error", name)
            fail(items, EngineError(f"internal engine error in stage {name!r}"))

    def _fail(self, items: list[WorkItem], exc: BaseException, phase: str) -> None:
        if isinstance(exc, FacegateError):
            log.debug("stage %s %s raised %s for a batch of %d", self.name, phase, exc.code, len(items))
        else:
            log.warning("stage %s %s failed for a batch of %d", self.name, phase, len(items), exc_info=exc)
        self.stats.stage_errors.labels(self.name, phase).inc(len(items))
        fail(items, as_facegate_error(exc, self.name, phase))


class Engine:
    """Cross-request dynamic batching over stages with unique names. ``max_queue`` is per stage (beyond:
    QueueFullError); ``device_thread`` runs every execute + deliver (a new one by default) and stops with the engine."""

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        max_batch_size: int = 64,
        max_wait_ms: float = 2.0,
        max_queue: int = 4096,
        request_timeout_s: float = 30.0,
        stats: ServiceStats | None = None,
        device_thread: DeviceThread | None = None,
    ) -> None:
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise InvalidParameterError(f"stage names must be unique, got {names}")
        self.stats = stats if stats is not None else ServiceStats()
        self.max_batch_size = int(max_batch_size)
        self.max_wait_ms = float(max_wait_ms)
        self.request_timeout_s = float(request_timeout_s)
        #: runs every execute + deliver; e.g. the warm-up runs here, where the batches will run
        self.device_executor = device_thread or DeviceThread()
        self._runners = {s.name: _StageRunner(s, self, int(max_queue)) for s in stages}
        self._state = "new"  # new -> running -> stopped
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the worker threads (idempotent while running; an engine cannot restart after stop)."""
        with self._lock:
            if self._state == "running":
                return
            if self._state == "stopped":
                raise EngineClosedError("this engine was stopped; build a new one")
            for r in self._runners.values():
                r.thread.start()
            self._state = "running"
        log.info(
            "engine started: stages=%s max_batch_size=%d max_wait_ms=%g",
            list(self._runners),
            self.max_batch_size,
            self.max_wait_ms,
        )

    def stop(self, drain: bool = True, *, timeout_s: float | None = 30.0) -> None:
        """Stop accepting work and shut the threads down (idempotent). ``drain``: compute what is queued first, else
        fail it with EngineClosedError; ``timeout_s``: the wait for the threads (a stuck stage's are left, logged)."""
        with self._lock:
            was = self._state
            self._state = "stopped"
        if was == "stopped":
            return
        for r in self._runners.values():
            r.abort = not drain
            r.batcher.close()
            if not drain:
                fail(r.batcher.drain(), EngineClosedError("engine stopped", detail={"stage": r.name}))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if was != "new":
            for r in self._runners.values():
                if not _join(r.thread, deadline):
                    log.error("stage %s did not stop within %s s", r.name, timeout_s)
        # after the front threads: they hand it their last batches
        self.device_executor.shutdown(wait=False)
        if not self.device_executor.join(deadline):
            log.error("the device thread did not stop within %s s", timeout_s)
        if was != "new":
            log.info("engine stopped (drain=%s)", drain)

    @property
    def ready(self) -> bool:
        """Running, and every stage's worker threads are alive."""
        return (
            self._state == "running"
            and self.device_executor.alive()
            and all(r.thread.is_alive() for r in self._runners.values())
        )

    async def submit(self, stage: str, payload: Any) -> Any:
        """What ``deliver`` gave for ``payload`` on ``stage`` within ``request_timeout_s``; cancelling the task
        cancels the item if not yet computed. Raises QueueFullError, DeadlineExceededError, EngineClosedError, or the
        stage's error."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        item = self.enqueue(stage, payload, fut)
        try:
            async with asyncio.timeout(self.request_timeout_s):  # cancels fut: the batcher drops the item
                return await fut
        except TimeoutError:
            msg = f"no result from stage {stage!r} within {self.request_timeout_s:g} s"
            raise DeadlineExceededError(msg, detail={"stage": stage}) from None
        except asyncio.CancelledError:
            item.cancel()
            raise

    def enqueue(self, stage: str, payload: Any, future: AnyFuture) -> WorkItem:
        """Queue one item without waiting (thread-safe; no event-loop task per request); its result goes to
        ``future`` (a concurrent one, or an asyncio one, settled on its own loop). Its deadline is
        ``request_timeout_s`` from now; nothing fails the future at the deadline during compute: the caller sweeps
        ``item.deadline``."""
        if self._state != "running":
            raise EngineClosedError(f"engine is {'not started' if self._state == 'new' else 'stopped'}")
        runner = self._runners.get(stage)
        if runner is None:
            raise EngineError(f"unknown stage {stage!r}", detail={"known": list(self._runners)})
        item = WorkItem(payload, future, time.monotonic() + self.request_timeout_s, cost=runner.cost(payload))
        runner.batcher.put(item)
        return item
