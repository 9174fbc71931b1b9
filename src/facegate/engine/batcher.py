"""The engine's bounded queue policy: work items and the batch collector.

A :class:`Batcher` is one stage's bounded FIFO (beyond ``max_queue``: QueueFullError, 503 + Retry-After).
Expired items and items nobody waits for are dropped before compute and counted (``facegate_dropped_total``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from facegate.errors import DeadlineExceededError, EngineClosedError, QueueFullError
from facegate.metrics.stats import ServiceStats

log = logging.getLogger(__name__)

AnyFuture = asyncio.Future[Any] | concurrent.futures.Future[Any]


@dataclass(slots=True, eq=False)
class WorkItem:
    """One unit of work for one stage: its ``payload``, the asyncio or concurrent ``future`` of its result,
    ``deadline`` and ``enqueued_at`` (``time.monotonic()``), and ``cost >= 1``, the rows it adds to a batch."""

    payload: Any
    future: AnyFuture
    deadline: float
    cost: int = 1
    enqueued_at: float = field(default_factory=time.monotonic, init=False)  # reset by Batcher.put
    _cancelled: bool = field(default=False, init=False)

    def cancel(self) -> None:
        """Mark the item as no longer wanted (thread-safe; idempotent). It will not be computed."""
        self._cancelled = True

    def drop_reason(self, now: float) -> str | None:
        """The ``facegate_dropped_total`` reason to drop the item: ``"expired"``, ``"cancelled"`` (also when the
        future is done, e.g. by the waiter's own deadline timer), or None while someone waits for it."""
        if now >= self.deadline:
            return "expired"
        return "cancelled" if self._cancelled or self.future.done() else None


def set_asyncio_many(entries: list[tuple[AnyFuture, bool, Any]]) -> None:
    """Complete ``(future, ok, value_or_exception)`` entries not yet done (asyncio ones on their own loop)."""
    for fut, ok, value in entries:
        if fut.done():
            continue
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # a concurrent one cancelled meanwhile
            fut.set_result(value) if ok else fut.set_exception(value)


def settle(outcomes: Iterable[tuple[AnyFuture, bool, Any]]) -> None:
    """Complete ``(future, ok, value_or_exception)`` entries from any thread, with one wake-up per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
    for fut, ok, value in outcomes:
        if isinstance(fut, asyncio.Future):
            by_loop.setdefault(fut.get_loop(), []).append((fut, ok, value))
        else:
            set_asyncio_many([(fut, ok, value)])
    for loop, entries in by_loop.items():
        try:
            loop.call_soon_threadsafe(set_asyncio_many, entries)
        except RuntimeError:  # loop closed
            log.debug("event loop closed; dropping %d results", len(entries))


def fail(items: Iterable[WorkItem], exc: BaseException) -> None:
    settle((it.future, False, exc) for it in items)


class Batcher:
    """One stage's bounded FIFO queue and batch collector (thread-safe); ``stats`` records depth, wait and drops."""

    def __init__(self, name: str, *, max_queue: int, stats: ServiceStats) -> None:
        self.name = name
        self.max_queue = int(max_queue)
        self._q: collections.deque[WorkItem] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        # Recent (time, n_taken) of collect() calls, to estimate the drain rate for Retry-After.
        self._taken: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._depth_gauge = stats.queue_depth.labels(name)
        self._wait_hist = stats.queue_wait.labels(name)
        self._dropped_expired = stats.dropped.labels(name, "expired")
        self._dropped_cancelled = stats.dropped.labels(name, "cancelled")

    def _retry_after_locked(self) -> float:
        """Seconds until the queue has drained at the rate of the last 64 batches, in ``[0.1, 30]``; 1 s before any."""
        if len(self._taken) < 2:
            return 1.0
        span = self._taken[-1][0] - self._taken[0][0]
        n = sum(k for _, k in list(self._taken)[1:])
        if span <= 0 or n <= 0:
            return 1.0
        return float(min(30.0, max(0.1, len(self._q) / (n / span))))

    def put(self, item: WorkItem) -> None:
        """Enqueue one item; EngineClosedError once closed, QueueFullError with ``max_queue`` live items waiting."""
        dropped: list[tuple[WorkItem, str]] = []
        try:
            with self._cond:
                if self._closed:
                    raise EngineClosedError(f"stage {self.name!r} is not accepting work", detail={"stage": self.name})
                if len(self._q) >= self.max_queue:  # purge the dead first
                    now = time.monotonic()
                    reasons = [(it, it.drop_reason(now)) for it in self._q]
                    dropped = [(it, reason) for it, reason in reasons if reason]
                    if dropped:  # the queue now has room: the gauge is set below
                        self._q = collections.deque(it for it, reason in reasons if not reason)
                    if len(self._q) >= self.max_queue:
                        retry = self._retry_after_locked()
                        raise QueueFullError(
                            f"stage {self.name!r} queue is full ({len(self._q)}/{self.max_queue}); retry later",
                            retry_after_s=retry,
                            detail={"stage": self.name, "depth": len(self._q), "max_queue": self.max_queue},
                        )
                item.enqueued_at = time.monotonic()
                self._q.append(item)
                self._depth_gauge.set(len(self._q))
                self._cond.notify()
        finally:
            self.finish_dropped(dropped)

    def collect(self, max_batch: int, max_wait_s: float, enough: Callable[[int], bool] | None = None) -> list[WorkItem]:
        """The next batch of live items, oldest first (``[]`` once closed and empty): those queued, to a ``cost`` of
        ``max_batch``, then more until ``max_wait_s`` after the first's *enqueue* or ``enough(cost)`` is true."""
        while True:
            batch: list[WorkItem] = []
            dropped: list[tuple[WorkItem, str]] = []
            cost = 0
            with self._cond:
                while True:
                    now = time.monotonic()
                    q = self._q
                    while q and cost < max_batch:
                        it = q[0]
                        if reason := it.drop_reason(now):
                            dropped.append((q.popleft(), reason))
                        elif batch and cost + it.cost > max_batch:
                            break  # the next item waits for the next batch (an oversized one runs alone)
                        else:
                            batch.append(q.popleft())
                            cost += it.cost
                    if q or cost >= max_batch or self._closed or (enough and enough(cost)):  # full, closed, enough
                        break
                    if not batch:
                        if dropped:  # report drops promptly instead of holding them while idle
                            break
                        self._cond.wait()
                        continue
                    remaining = batch[0].enqueued_at + max_wait_s - now
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if batch:
                    self._taken.append((time.monotonic(), len(batch)))
                self._depth_gauge.set(len(self._q))
            # Items may have been cancelled while the window was open: filter once more.
            now = time.monotonic()
            reasons = [(it, it.drop_reason(now)) for it in batch]
            live = [it for it, reason in reasons if not reason]
            self.finish_dropped(dropped + [(it, reason) for it, reason in reasons if reason])
            if live:
                for it in live:
                    self._wait_hist.observe(now - it.enqueued_at)
                return live
            if self._closed and not self._q:
                return []

    def close(self) -> None:
        """Refuse new work; a blocked :meth:`collect` returns what is left, then ``[]``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[WorkItem]:
        """Remove and return every queued item (for a non-draining stop)."""
        with self._cond:
            items = list(self._q)
            self._q.clear()
            self._depth_gauge.set(len(self._q))
        return items

    def finish_dropped(self, dropped: list[tuple[WorkItem, str]]) -> None:
        """Outside the lock: count ``(item, drop_reason)`` drops, give expired items DeadlineExceededError."""
        if not dropped:
            return
        expired = [it for it, reason in dropped if reason == "expired"]
        n_cancelled = len(dropped) - len(expired)
        self._dropped_expired.inc(len(expired))
        self._dropped_cancelled.inc(n_cancelled)
        msg = "deadline passed after {:.3f} s, before stage {!r} computed the work"
        settle(
            (
                it.future,
                False,
                DeadlineExceededError(msg.format(it.deadline - it.enqueued_at, self.name), detail={"stage": self.name}),
            )
            for it in expired
        )
        log.debug("stage %s dropped %d expired, %d cancelled", self.name, len(expired), n_cancelled)
