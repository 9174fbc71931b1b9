"""Engine: dynamic batching correctness, drops before compute, error isolation, stop/drain, overlap."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from facegate.engine.engine import DeviceThread, Engine, Stage
from facegate.errors import (
    DeadlineExceededError,
    EngineClosedError,
    EngineError,
    InvalidParameterError,
    NoFaceError,
    QueueFullError,
)
from facegate.metrics.stats import ServiceStats

DIM = 16


def payload(i: int) -> np.ndarray:
    """A deterministic ``(DIM,) int64`` payload."""
    return np.arange(DIM, dtype=np.int64) * (i + 1) - 7 * i


def alone(p: np.ndarray) -> np.ndarray:
    """What :class:`FakeStage` computes for one item on its own: ``(DIM,) int64``."""
    return np.cumsum(p * 3 + 1)


def submit_sync(engine: Engine, stage: str, payload: Any) -> Any:
    """Blocking submit through :meth:`Engine.enqueue` (as the engine process's readers use it)."""
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    timeout = engine.request_timeout_s  # the item's, read before anyone changes it
    item = engine.enqueue(stage, payload, fut)
    try:
        return fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        item.cancel()
        if fut.cancel():
            raise DeadlineExceededError(f"no result from stage {stage!r} within {timeout:g} s") from None
        return fut.result()


async def submit_many(engine: Engine, stage: str, payloads: list[Any], return_exceptions: bool = False) -> list[Any]:
    return list(await asyncio.gather(*(engine.submit(stage, p) for p in payloads), return_exceptions=return_exceptions))


class FakeStage:
    """Deterministic integer stage (exact results whatever the batch size) that records what it sees.

    ``prepare`` stacks to ``(B, DIM) int64``; ``execute`` computes ``cumsum(x*3+1, axis=1)`` row-wise;
    ``deliver`` splits rows. Optional sleeps, a gate that blocks ``prepare`` on a marked payload, and
    failure injection.
    """

    def __init__(
        self,
        name: str = "fake",
        *,
        prep_s: float = 0.0,
        exec_s: float = 0.0,
        execute_error: Callable[[list[int]], BaseException | None] | None = None,
    ) -> None:
        self.name = name
        self.prep_s, self.exec_s = prep_s, exec_s
        self.execute_error = execute_error
        self.prepared_ids: list[list[int]] = []
        self.executed_ids: list[list[int]] = []
        self.prep_spans: list[tuple[float, float]] = []
        self.exec_spans: list[tuple[float, float]] = []
        self.prep_threads: set[str] = set()
        self.exec_threads: set[str] = set()
        self.gate = threading.Event()
        self.gate_id: int | None = None
        self.gate_entered = threading.Event()

    def prepare(self, payloads: list[Any]) -> tuple[list[int], np.ndarray]:
        t0 = time.monotonic()
        ids = [int(p[0][0]) for p in payloads]
        self.prepared_ids.append(ids)
        self.prep_threads.add(threading.current_thread().name)
        if self.gate_id is not None and self.gate_id in ids:
            self.gate_entered.set()
            assert self.gate.wait(10)
        if self.prep_s:
            time.sleep(self.prep_s)
        x = np.stack([p[1] for p in payloads])
        self.prep_spans.append((t0, time.monotonic()))
        return ids, x

    def execute(self, prepared: tuple[list[int], np.ndarray]) -> np.ndarray:
        t0 = time.monotonic()
        ids, x = prepared
        self.executed_ids.append(ids)
        self.exec_threads.add(threading.current_thread().name)
        if self.exec_s:
            time.sleep(self.exec_s)
        if self.execute_error is not None:
            err = self.execute_error(ids)
            if err is not None:
                raise err
        out = np.cumsum(x * 3 + 1, axis=1)
        self.exec_spans.append((t0, time.monotonic()))
        return out

    def deliver(self, result: np.ndarray, n: int) -> list[Any]:
        return [result[i].copy() for i in range(n)]


def item(i: int) -> tuple[np.ndarray, np.ndarray]:
    """Payload carrying its id (for bookkeeping in the fake) and its data."""
    return np.array([i]), payload(i)


def make_engine(stage: Stage, **kw: Any) -> Engine:
    kw.setdefault("max_batch_size", 64)
    kw.setdefault("max_wait_ms", 5.0)
    kw.setdefault("max_queue", 1024)
    kw.setdefault("request_timeout_s", 10.0)
    kw.setdefault("stats", ServiceStats())
    return Engine([stage], **kw)


@contextlib.contextmanager
def running(engine: Engine) -> Iterator[Engine]:
    """The engine started for the block, then stopped (draining)."""
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    t_end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > t_end:
            raise AssertionError("condition not reached")
        time.sleep(0.002)


async def submit_n(engine: Engine, n: int, stage: str = "fake") -> list[Any]:
    return await asyncio.gather(*(engine.submit(stage, item(i)) for i in range(n)))


# --------------------------------------------------------------------------- correctness & batching
@pytest.mark.parametrize("batching", [True, False])
def test_64_concurrent_submits_exact_results(batching: bool) -> None:
    stage = FakeStage(exec_s=0.005)
    engine = make_engine(stage, max_batch_size=64 if batching else 1, max_wait_ms=20.0)
    with running(engine):
        results = asyncio.run(submit_n(engine, 64))
    for i, r in enumerate(results):
        assert r.dtype == np.int64 and np.array_equal(r, alone(payload(i))), i
    sizes = [len(b) for b in stage.executed_ids]
    assert sum(sizes) == 64
    stats = engine.stats
    mean = stats.value("facegate_batch_size_sum", stage="fake") / stats.value("facegate_batch_size_count", stage="fake")
    assert mean == pytest.approx(64 / len(sizes))
    if batching:
        assert mean > 1.0 and max(sizes) > 1
    else:
        assert mean == 1.0 and set(sizes) == {1}
    # Order within every batch is the submission (FIFO) order.
    for ids in stage.executed_ids:
        assert ids == sorted(ids)
    assert engine.stats.value("facegate_items_total", stage="fake") == 64
    assert engine.stats.value("facegate_queue_wait_seconds_count", stage="fake") == 64


def test_batches_of_one_and_of_many_give_identical_results() -> None:
    outs = []
    for batching in (True, False):
        engine = make_engine(FakeStage(exec_s=0.002), max_batch_size=64 if batching else 1, max_wait_ms=10.0)
        with running(engine):
            outs.append(asyncio.run(submit_n(engine, 64)))
    for a, b in zip(*outs, strict=True):
        assert np.array_equal(a, b)


def test_submit_sync_and_submit_many() -> None:
    stage = FakeStage()
    with running(make_engine(stage)) as engine:
        assert np.array_equal(submit_sync(engine, "fake", item(3)), alone(payload(3)))
        res = asyncio.run(submit_many(engine, "fake", [item(i) for i in range(10)]))
    assert all(np.array_equal(r, alone(payload(i))) for i, r in enumerate(res))


# --------------------------------------------------------------------------- queue policy
def test_queue_full_raises() -> None:
    stage = FakeStage()
    stage.gate_id = 0
    engine = make_engine(stage, max_queue=2)
    engine.start()
    try:

        async def main() -> None:
            first = asyncio.create_task(engine.submit("fake", item(0)))
            await asyncio.to_thread(stage.gate_entered.wait, 5)  # item 0 is inside prepare
            queued = [asyncio.create_task(engine.submit("fake", item(i))) for i in (1, 2)]
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError) as ei:
                await engine.submit("fake", item(3))
            assert ei.value.retry_after_s > 0
            stage.gate.set()
            await asyncio.gather(first, *queued)

        asyncio.run(main())
    finally:
        stage.gate.set()
        engine.stop()


def test_expired_item_is_dropped_before_compute() -> None:
    stage = FakeStage()
    stage.gate_id = 0
    engine = make_engine(stage)
    engine.start()
    try:
        t = threading.Thread(target=submit_sync, args=(engine, "fake", item(0)))
        t.start()
        assert stage.gate_entered.wait(5)
        t0 = time.monotonic()
        engine.request_timeout_s = 0.05  # for the items queued from now on
        with pytest.raises(DeadlineExceededError):
            submit_sync(engine, "fake", item(1))
        assert time.monotonic() - t0 < 2.0

        async def late() -> None:
            with pytest.raises(DeadlineExceededError):
                await engine.submit("fake", item(2))

        asyncio.run(late())
        engine.request_timeout_s = 10.0
        stage.gate.set()
        t.join(5)
        assert np.array_equal(submit_sync(engine, "fake", item(3)), alone(payload(3)))
    finally:
        stage.gate.set()
        engine.stop()
    seen = [i for b in stage.prepared_ids for i in b]
    assert 1 not in seen and 2 not in seen  # the stage never saw the expired items
    assert seen == [0, 3]
    assert engine.stats.value("facegate_dropped_total", stage="fake", reason="expired") == 2


def test_cancelled_task_item_is_dropped() -> None:
    stage = FakeStage()
    stage.gate_id = 0
    engine = make_engine(stage)
    engine.start()
    try:

        async def main() -> None:
            first = asyncio.create_task(engine.submit("fake", item(0)))
            await asyncio.to_thread(stage.gate_entered.wait, 5)
            doomed = asyncio.create_task(engine.submit("fake", item(1)))
            await asyncio.sleep(0.02)
            doomed.cancel()  # the HTTP client disconnected
            with pytest.raises(asyncio.CancelledError):
                await doomed
            stage.gate.set()
            await first
            r = await engine.submit("fake", item(2))
            assert np.array_equal(r, alone(payload(2)))

        asyncio.run(main())
    finally:
        stage.gate.set()
        engine.stop()
    assert [i for b in stage.prepared_ids for i in b] == [0, 2]
    assert engine.stats.value("facegate_dropped_total", stage="fake", reason="cancelled") == 1


def test_batch_whose_items_all_left_skips_the_device() -> None:
    stage = FakeStage()
    stage.gate_id = 0
    engine = make_engine(stage)
    engine.start()
    try:
        engine.request_timeout_s = 0.1
        with pytest.raises(DeadlineExceededError):
            submit_sync(engine, "fake", item(0))  # stuck in prepare past its deadline
        engine.request_timeout_s = 10.0
        stage.gate.set()
        assert np.array_equal(submit_sync(engine, "fake", item(1)), alone(payload(1)))
    finally:
        stage.gate.set()
        engine.stop()
    assert stage.executed_ids == [[1]]
    assert engine.stats.value("facegate_dropped_total", stage="fake", reason="expired") == 1


# --------------------------------------------------------------------------- errors
def test_stage_exception_is_isolated_to_its_batch() -> None:
    def boom(ids: list[int]) -> BaseException | None:
        return RuntimeError("kaboom") if 5 in ids else None

    stage = FakeStage(execute_error=boom)
    engine = make_engine(stage, max_batch_size=1)
    with running(engine):

        async def main() -> list[Any]:
            return await asyncio.gather(*(engine.submit("fake", item(i)) for i in range(10)), return_exceptions=True)

        res = asyncio.run(main())
        assert engine.ready  # still running
        assert np.array_equal(submit_sync(engine, "fake", item(11)), alone(payload(11)))
    err = res[5]
    assert type(err) is EngineError and "kaboom" in str(err) and "RuntimeError" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    for i, r in enumerate(res):
        if i != 5:
            assert np.array_equal(r, alone(payload(i)))
    assert engine.stats.value("facegate_stage_errors_total", stage="fake", phase="execute") == 1


def test_exception_goes_to_every_item_of_the_batch_and_facegate_errors_pass_through() -> None:
    no_face = NoFaceError("no face here")
    stage = FakeStage(execute_error=lambda ids: no_face if 2 in ids else None)
    stage.gate_id = 0
    engine = make_engine(stage, max_wait_ms=100.0)
    engine.start()
    try:

        async def main() -> list[Any]:
            first = asyncio.create_task(engine.submit("fake", item(0)))
            await asyncio.to_thread(stage.gate_entered.wait, 5)
            rest = [asyncio.create_task(engine.submit("fake", item(i))) for i in (1, 2, 3)]
            await asyncio.sleep(0.01)
            stage.gate.set()
            return await asyncio.gather(first, *rest, return_exceptions=True)

        res = asyncio.run(main())
        after = submit_sync(engine, "fake", item(4))
    finally:
        stage.gate.set()
        engine.stop()
    assert stage.executed_ids[:2] == [[0], [1, 2, 3]]
    assert np.array_equal(res[0], alone(payload(0)))
    assert all(r is no_face for r in res[1:])  # the same instance, unchanged, for every item of the batch
    assert np.array_equal(after, alone(payload(4)))


def test_per_item_exceptions_from_deliver_and_bad_deliver_length() -> None:
    class PartlyFailing(FakeStage):
        def deliver(self, result: np.ndarray, n: int) -> list[Any]:
            out = super().deliver(result, n)
            return [ValueError("bad item") if int(r[0]) % 2 else r for r in out]

    class WrongCount(FakeStage):
        def deliver(self, result: np.ndarray, n: int) -> list[Any]:
            return super().deliver(result, n)[:-1]

    with running(make_engine(PartlyFailing(), max_batch_size=1)) as engine:
        res = asyncio.run(submit_many(engine, "fake", [item(i) for i in range(4)], return_exceptions=True))
    odd = [int(alone(payload(i))[0]) % 2 == 1 for i in range(4)]
    for r, is_odd in zip(res, odd, strict=True):
        assert isinstance(r, EngineError) if is_odd else isinstance(r, np.ndarray)
    with running(make_engine(WrongCount())) as engine, pytest.raises(EngineError, match="deliver returned"):
        submit_sync(engine, "fake", item(0))


# --------------------------------------------------------------------------- lifecycle
def test_lifecycle_ready_and_closed_errors() -> None:
    engine = make_engine(FakeStage())
    assert not engine.ready
    with pytest.raises(EngineClosedError):
        submit_sync(engine, "fake", item(0))
    engine.start()
    assert engine.ready
    with pytest.raises(EngineError, match="unknown stage"):
        submit_sync(engine, "nope", item(0))
    engine.stop()
    assert not engine.ready
    with pytest.raises(EngineClosedError):
        submit_sync(engine, "fake", item(0))
    with pytest.raises(EngineClosedError):
        engine.start()
    with pytest.raises(InvalidParameterError):
        Engine([FakeStage(), FakeStage()])


def test_stop_with_drain_completes_everything_queued() -> None:
    stage = FakeStage(exec_s=0.01)
    engine = make_engine(stage, max_batch_size=1)
    engine.start()

    async def main() -> list[Any]:
        tasks = [asyncio.create_task(engine.submit("fake", item(i))) for i in range(10)]
        await asyncio.sleep(0)  # all queued
        await asyncio.to_thread(engine.stop, True)
        return await asyncio.gather(*tasks)

    res = asyncio.run(main())
    assert all(np.array_equal(r, alone(payload(i))) for i, r in enumerate(res))
    assert sum(len(b) for b in stage.executed_ids) == 10


def test_stop_without_drain_fails_pending_with_engine_closed() -> None:
    stage = FakeStage()
    stage.gate_id = 0
    engine = make_engine(stage)
    engine.start()

    async def main() -> list[Any]:
        tasks = [asyncio.create_task(engine.submit("fake", item(0)))]
        await asyncio.to_thread(stage.gate_entered.wait, 5)
        tasks += [asyncio.create_task(engine.submit("fake", item(i))) for i in range(1, 5)]
        await asyncio.sleep(0.01)
        stopper = asyncio.create_task(asyncio.to_thread(engine.stop, False))
        queued = await asyncio.gather(*tasks[1:], return_exceptions=True)  # failed before the gate opens
        stage.gate.set()
        await stopper
        return [*(await asyncio.gather(tasks[0], return_exceptions=True)), *queued]

    try:
        res = asyncio.run(main())
    finally:
        stage.gate.set()
    assert all(isinstance(r, EngineClosedError) for r in res)  # item 0 was prepared but never executed
    assert stage.executed_ids == []
    assert not engine.ready


# --------------------------------------------------------------------------- overlap
def test_prepare_overlaps_execute() -> None:
    """10 batches of prepare 20 ms + execute 20 ms: serial takes the sum of the spans, pipelined about half."""
    stage = FakeStage(prep_s=0.02, exec_s=0.02)
    engine = make_engine(stage, max_batch_size=1)
    with running(engine):

        async def main() -> float:
            t0 = time.monotonic()
            await submit_many(engine, "fake", [item(i) for i in range(10)])
            return time.monotonic() - t0

        elapsed = asyncio.run(main())
    assert len(stage.executed_ids) == 10
    # against the serial time of the same run's own spans, so a loaded machine slows both sides alike
    serial = sum(p1 - p0 for p0, p1 in stage.prep_spans) + sum(e1 - e0 for e0, e1 in stage.exec_spans)
    assert elapsed < 0.85 * serial, f"no overlap: {elapsed:.3f} s of {serial:.3f} s serial"
    overlaps = sum(1 for p0, p1 in stage.prep_spans for e0, e1 in stage.exec_spans if min(p1, e1) - max(p0, e0) > 0.005)
    assert overlaps >= 5
    assert engine.stats.value("facegate_compute_seconds_count", stage="fake", phase="execute") == 10
    assert engine.stats.value("facegate_compute_seconds_sum", stage="fake", phase="execute") >= 0.2


class RowsStage:
    """A stage whose payload is a request's ``(k, DIM) int64`` rows (like a request's face crops)."""

    name = "rows"

    def __init__(self) -> None:
        self.batch_rows: list[int] = []

    def item_cost(self, payload: np.ndarray) -> int:
        return len(payload)

    def prepare(self, payloads: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
        return np.concatenate(payloads), [len(p) for p in payloads]

    def execute(self, prepared: tuple[np.ndarray, list[int]]) -> tuple[np.ndarray, list[int]]:
        x, sizes = prepared
        self.batch_rows.append(len(x))
        time.sleep(0.005)
        return np.cumsum(x * 3 + 1, axis=1), sizes

    def deliver(self, result: tuple[np.ndarray, list[int]], n: int) -> list[np.ndarray]:
        out, sizes = result
        return np.split(out, np.cumsum(sizes)[:-1])


def test_item_cost_limits_rows_per_batch_and_counts_rows() -> None:
    stage = RowsStage()
    engine = make_engine(stage, max_batch_size=16, max_wait_ms=20.0)
    reqs = [np.stack([payload(10 * r + j) for j in range(1 + r % 5)]) for r in range(20)] + [
        np.stack([payload(j) for j in range(40)])  # larger than the limit: runs alone
    ]
    with running(engine):
        res = asyncio.run(submit_many(engine, "rows", reqs))
    for req, out in zip(reqs, res, strict=True):
        assert np.array_equal(out, np.stack([alone(p) for p in req]))
    total = sum(len(r) for r in reqs)
    assert sum(stage.batch_rows) == total and 40 in stage.batch_rows
    assert all(n <= 16 for n in stage.batch_rows if n != 40)
    assert engine.stats.value("facegate_items_total", stage="rows") == total
    assert engine.stats.value("facegate_batch_size_sum", stage="rows") == total


# --------------------------------------------------------------------------- one shared device thread
async def _both_stages(engine: Engine, n: int) -> tuple[list[Any], list[Any]]:
    a = asyncio.gather(*(engine.submit("a", item(i)) for i in range(n)))
    b = asyncio.gather(*(engine.submit("b", item(i)) for i in range(n)))
    return await a, await b


@pytest.mark.parametrize("given", [True, False])
def test_one_device_thread_runs_every_stage_execute(given: bool) -> None:
    sa, sb = FakeStage("a", exec_s=0.003), FakeStage("b", exec_s=0.003)
    device = DeviceThread() if given else None
    engine = Engine([sa, sb], max_batch_size=8, max_wait_ms=2.0, stats=ServiceStats(), device_thread=device)
    assert isinstance(engine.device_executor, DeviceThread)
    assert engine.device_executor is device or not given
    with running(engine):
        assert engine.ready
        ra, rb = asyncio.run(_both_stages(engine, 40))
    for i in range(40):
        assert np.array_equal(ra[i], alone(payload(i))) and np.array_equal(rb[i], alone(payload(i)))
    assert sa.prep_threads == {"facegate-a-prepare"} and sb.prep_threads == {"facegate-b-prepare"}
    assert sa.exec_threads == sb.exec_threads == {"facegate-device"}
    spans = sorted(sa.exec_spans + sb.exec_spans)  # one thread: the two stages never execute at once
    assert all(e0 <= s1 for (_, e0), (s1, _) in itertools.pairwise(spans))
    assert not engine.ready


def test_shared_device_thread_runs_submitted_work_first_and_stops_with_the_engine() -> None:
    stage = FakeStage("a", exec_s=0.005)
    device = DeviceThread()
    engine = Engine([stage], stats=ServiceStats(), device_thread=device)
    warm = device.submit(threading.current_thread)  # the warm-up's place: before the engine starts
    assert warm.result(5).name == "facegate-device"
    engine.start()

    async def main() -> list[Any]:
        tasks = [asyncio.create_task(engine.submit("a", item(i))) for i in range(10)]
        await asyncio.sleep(0)
        await asyncio.to_thread(engine.stop, True)  # drain: everything queued is computed
        return await asyncio.gather(*tasks)

    res = asyncio.run(main())
    assert all(np.array_equal(r, alone(payload(i))) for i, r in enumerate(res))
    assert device.join(time.monotonic() + 5) and not device.alive()
    with pytest.raises(EngineClosedError):
        device.submit(print)


def test_device_thread_passes_exceptions_and_ends_unstarted() -> None:
    device = DeviceThread()

    def boom() -> None:
        raise ValueError("x")

    with pytest.raises(ValueError, match="x"):
        device.submit(boom).result(5)
    assert device.submit(lambda a, b=0: a + b, 2, b=3).result(5) == 5
    device.shutdown(wait=True)
    assert not device.alive()
    idle = DeviceThread()
    assert idle.alive()  # not started: nothing to be dead
    idle.shutdown(wait=True)
    assert idle.join(None)


def test_device_thread_is_idle_while_a_thread_is_free() -> None:
    """``idle`` counts what was submitted and has not finished (raised, or cancelled before it ran, too)."""
    device, release = DeviceThread(threads=2), threading.Event()
    assert device.idle()
    first = device.submit(release.wait)
    assert device.idle()  # one of two threads busy
    second, third = device.submit(release.wait), device.submit(lambda: 1 / 0)
    assert not device.idle() and third.cancel()  # both threads busy; the third waits, and is cancelled
    release.set()
    assert first.result(5) and second.result(5)
    with pytest.raises(ZeroDivisionError):
        device.submit(lambda: 1 / 0).result(5)
    device.shutdown(wait=True)  # its threads end after what was queued: every count is in
    assert device._busy == 0 and device.idle()


def test_device_threads_run_two_stages_at_once_and_all_stop() -> None:
    """Several device threads (the CPU plan): batches of two stages execute at once, results unchanged; stopping the
    engine ends every thread."""
    meet = threading.Barrier(2, timeout=10)  # each stage's first execute waits for the other's: one thread fails
    waited: set[str] = set()
    sa, sb = FakeStage("a", exec_s=0.002), FakeStage("b", exec_s=0.002)
    for st in (sa, sb):

        def execute(prepared: Any, run: Callable[[Any], Any] = st.execute, name: str = st.name) -> Any:
            if name not in waited:
                waited.add(name)
                meet.wait()
            return run(prepared)

        st.execute = execute  # type: ignore[method-assign]
    device = DeviceThread(threads=2)
    engine = Engine([sa, sb], max_batch_size=8, stats=ServiceStats(), device_thread=device)
    enough = engine._runners["a"].enough  # a batch with a row per device thread waits no longer while one is free
    assert enough is not None and device.idle() and enough(2) and not enough(1)
    assert Engine([FakeStage("c")], stats=ServiceStats())._runners["c"].enough is None  # one thread: fill the batch
    with running(engine):
        ra, rb = asyncio.run(_both_stages(engine, 20))
    assert all(np.array_equal(ra[i], alone(payload(i))) and np.array_equal(rb[i], alone(payload(i))) for i in range(20))
    assert sa.exec_threads == sb.exec_threads == {"facegate-device"}
    assert device.join(time.monotonic() + 5) and not device.alive()
    assert not any(t.is_alive() for t in device._threads)


def test_engine_stopped_before_start_shuts_its_device_thread_down() -> None:
    device = DeviceThread()
    engine = Engine([FakeStage("a")], stats=ServiceStats(), device_thread=device)
    device.submit(lambda: None).result(5)  # started by a warm-up
    engine.stop()
    assert device.join(time.monotonic() + 5)
    with pytest.raises(EngineClosedError):
        engine.start()
