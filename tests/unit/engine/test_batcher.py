"""Batcher queue policy and WorkItem: bounds, batching window, drops before compute, futures."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

import pytest

from facegate.engine.batcher import Batcher, WorkItem, settle
from facegate.errors import DeadlineExceededError, EngineClosedError, QueueFullError
from facegate.metrics.stats import ServiceStats


def _item(payload: Any, timeout_s: float = 10.0) -> WorkItem:
    return WorkItem(payload, concurrent.futures.Future(), time.monotonic() + timeout_s)


def _batcher(max_queue: int = 100) -> tuple[Batcher, ServiceStats]:
    stats = ServiceStats()
    stats.register_stage("s")
    return Batcher("s", max_queue=max_queue, stats=stats), stats


def test_fifo_and_max_batch() -> None:
    b, stats = _batcher()
    for i in range(10):
        b.put(_item(i))
    assert stats.value("facegate_queue_depth", stage="s") == 10
    assert [it.payload for it in b.collect(4, 0.0)] == [0, 1, 2, 3]
    assert [it.payload for it in b.collect(100, 0.0)] == [4, 5, 6, 7, 8, 9]
    assert stats.value("facegate_queue_depth", stage="s") == 0
    assert stats.value("facegate_queue_wait_seconds_count", stage="s") == 10


def test_queue_full_raises_with_retry_after() -> None:
    b, stats = _batcher(max_queue=3)
    for i in range(3):
        b.put(_item(i))
    with pytest.raises(QueueFullError) as ei:
        b.put(_item(99))
    assert ei.value.retry_after_s > 0
    assert ei.value.code == "queue_full"
    assert stats.value("facegate_queue_depth", stage="s") == 3


def test_full_queue_purges_dead_items_first() -> None:
    b, stats = _batcher(max_queue=2)
    a, c = _item("a"), _item("c")
    b.put(a)
    b.put(c)
    a.cancel()
    b.put(_item("new"))  # succeeds: the cancelled item made room
    assert [it.payload for it in b.collect(10, 0.0)] == ["c", "new"]
    assert stats.value("facegate_dropped_total", stage="s", reason="cancelled") == 1


def test_expired_item_dropped_before_compute_with_deadline_error() -> None:
    b, stats = _batcher()
    old = _item("old", timeout_s=0.01)
    b.put(old)
    b.put(_item("fresh"))
    time.sleep(0.03)
    batch = b.collect(10, 0.0)
    assert [it.payload for it in batch] == ["fresh"]
    with pytest.raises(DeadlineExceededError):
        old.future.result(timeout=1)
    assert stats.value("facegate_dropped_total", stage="s", reason="expired") == 1
    assert stats.value("facegate_dropped_total", stage="s", reason="cancelled") == 0


def test_window_waits_max_wait_after_first_item() -> None:
    b, _ = _batcher()
    b.put(_item(0))
    t0 = time.monotonic()
    batch = b.collect(8, 0.15)
    dt = time.monotonic() - t0
    assert len(batch) == 1
    assert 0.1 <= dt < 1.0


def test_window_is_measured_from_enqueue_not_from_collect() -> None:
    b, _ = _batcher()
    b.put(_item(0))
    time.sleep(0.3)  # the item already waited longer than the window
    t0 = time.monotonic()
    assert len(b.collect(8, 0.25)) == 1
    assert time.monotonic() - t0 < 0.25  # a window counted from collect would have waited all of it


def test_full_batch_returns_without_waiting() -> None:
    b, _ = _batcher()
    for i in range(8):
        b.put(_item(i))
    t0 = time.monotonic()
    assert len(b.collect(8, 5.0)) == 8
    assert time.monotonic() - t0 < 2.5  # well inside the 5 s window it would otherwise wait


def test_enough_ends_the_wait_with_all_that_is_queued() -> None:
    """``enough(cost)`` (the CPU: a row per core and a device thread free) ends the wait, not the batch: what is
    queued still joins, to ``max_batch``; while it is false the window is waited as before."""
    b, _ = _batcher()
    for i in range(3):
        b.put(_item(i))
    t0 = time.monotonic()
    assert [it.payload for it in b.collect(8, 5.0, lambda cost: cost >= 2)] == [0, 1, 2]
    assert time.monotonic() - t0 < 2.5  # well inside the 5 s window
    for i in range(3):
        b.put(_item(i))
    t0 = time.monotonic()
    assert len(b.collect(8, 0.15, lambda cost: False)) == 3
    assert time.monotonic() - t0 >= 0.1


def test_items_arriving_during_window_join_the_batch() -> None:
    b, _ = _batcher()

    def feeder() -> None:
        for i in range(1, 4):
            time.sleep(0.01)
            b.put(_item(i))

    b.put(_item(0))
    t = threading.Thread(target=feeder)
    t.start()
    batch = b.collect(4, 2.0)  # returns as soon as 4 are there, long before 2 s
    t.join()
    assert [it.payload for it in batch] == [0, 1, 2, 3]


def test_collect_blocks_until_first_item() -> None:
    b, _ = _batcher()
    out: list[list[WorkItem]] = []
    t = threading.Thread(target=lambda: out.append(b.collect(4, 0.0)))
    t.start()
    time.sleep(0.05)
    assert not out  # still blocked
    b.put(_item("x"))
    t.join(2)
    assert [it.payload for it in out[0]] == ["x"]


def test_close_wakes_collect_and_drains_then_empty() -> None:
    b, _ = _batcher()
    out: list[list[WorkItem]] = []
    t = threading.Thread(target=lambda: out.append(b.collect(4, 0.0)))
    t.start()
    time.sleep(0.02)
    b.close()
    t.join(2)
    assert out == [[]]
    with pytest.raises(EngineClosedError):
        b.put(_item(1))

    b2, _ = _batcher()
    b2.put(_item(1))
    b2.put(_item(2))
    b2.close()
    t0 = time.monotonic()
    assert [it.payload for it in b2.collect(8, 5.0)] == [1, 2]  # closed: no waiting for the window
    assert time.monotonic() - t0 < 2.5
    assert b2.collect(8, 5.0) == []


def test_drain_returns_everything() -> None:
    b, stats = _batcher()
    for i in range(5):
        b.put(_item(i))
    assert [it.payload for it in b.drain()] == [0, 1, 2, 3, 4]
    assert len(b._q) == 0 and stats.value("facegate_queue_depth", stage="s") == 0


def test_asyncio_future_of_cancelled_task_counts_as_cancelled() -> None:
    b, stats = _batcher()

    async def main() -> WorkItem:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        item = WorkItem("p", fut, time.monotonic() + 10)
        b.put(item)

        async def waiter() -> Any:
            return await fut

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        task.cancel()  # what the server does when the HTTP client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        return item

    item = asyncio.run(main())
    assert item.future.cancelled()
    b.put(_item("live"))
    assert [it.payload for it in b.collect(8, 0.0)] == ["live"]
    assert stats.value("facegate_dropped_total", stage="s", reason="cancelled") == 1


def test_settle_from_worker_thread_completes_asyncio_futures_in_order() -> None:
    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        items = [WorkItem(i, loop.create_future(), time.monotonic() + 10) for i in range(5)]
        bad = items[3]
        outcomes = [(it.future, it is not bad, ValueError("x") if it is bad else it.payload * 10) for it in items]
        threading.Thread(target=settle, args=(outcomes,)).start()
        return await asyncio.gather(*(it.future for it in items), return_exceptions=True)

    res = asyncio.run(main())
    assert res[:3] == [0, 10, 20] and res[4] == 40
    assert isinstance(res[3], ValueError)


def test_settle_ignores_closed_loop_and_done_futures() -> None:
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    loop.close()
    cf: concurrent.futures.Future[Any] = concurrent.futures.Future()
    cf.cancel()
    settle([(fut, True, 1), (cf, True, 2)])  # no exception
    assert not fut.done() and cf.cancelled()


def test_cost_limits_batches_and_oversized_item_runs_alone() -> None:
    b, _ = _batcher()
    for i, c in enumerate([3, 3, 3, 20, 1]):
        b.put(WorkItem(i, concurrent.futures.Future(), time.monotonic() + 10, cost=c))
    t0 = time.monotonic()
    assert [it.payload for it in b.collect(8, 5.0)] == [0, 1]  # 3+3; the next 3 would not fit: no waiting
    assert time.monotonic() - t0 < 2.5
    assert [it.payload for it in b.collect(8, 0.0)] == [2]  # 3 + 20 > 8
    assert [it.payload for it in b.collect(8, 0.0)] == [3]  # larger than the limit: alone
    assert [it.payload for it in b.collect(8, 0.0)] == [4]
