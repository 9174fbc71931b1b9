"""RayEngine: concurrent items leave in one call; a lost replica is retried once, then 503; Serve's back-pressure
is queue_full.

The handle here is a stand-in that raises Ray's own exception classes the way a DeploymentHandle's response
does; the real handle and real replica deaths are in tests/integration/test_ray_serve.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("ray") is None:
    if os.environ.get("CI"):
        raise ImportError("ray is not installed; CI must install facegate[ray]")
    pytest.skip("ray is not installed (pip install 'facegate[ray]')", allow_module_level=True)

from ray import exceptions as rex
from ray.serve import exceptions as sex

from facegate.errors import DeadlineExceededError, EngineClosedError, NoFaceError, QueueFullError
from facegate.scaleout.ray_engine import DIRECT_MAX_BYTES, RayEngine, Served, record_replicas
from facegate.transport.remote import error_to_wire


class _Response:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.cancelled = False

    def __await__(self) -> Any:
        async def get() -> Any:
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        return get().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes = outcomes
        self.calls = 0
        self.args: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> _Response:
        self.calls += 1
        self.args.append(args)
        return _Response(self.outcomes.pop(0))


class _Handle:
    """A handle whose by-value copy (``options(_by_reference=False)``) is ``direct``, itself unless given."""

    def __init__(self, direct: _Handle | None = None, **methods: list[Any]) -> None:
        self.info = _Method([("r0", {"model": "sface"})])
        for name, outcomes in methods.items():
            setattr(self, name, _Method(outcomes))
        self.direct = direct
        self.options_kw: dict[str, Any] = {}

    def options(self, **kw: Any) -> _Handle:
        self.options_kw = kw
        return self if self.direct is None else self.direct


def _started(handle: _Handle, **kw: Any) -> RayEngine:
    engine = RayEngine(handle, **kw)
    asyncio.run(engine.astart())
    return engine


def test_a_lost_replica_is_retried_on_another() -> None:
    handle = _Handle(submit_many=[rex.ActorDiedError(), ("r2", [("ok", "embedding")])])
    engine = _started(handle)

    async def go() -> tuple[Any, Served]:
        with record_replicas() as served:
            return await engine.submit("embed", np.zeros((1, 112, 112, 3), np.uint8)), served

    result, served = asyncio.run(go())
    assert result == "embedding" and served.replicas == ["r2"] and served.retries == 1
    assert handle.submit_many.calls == 2


def test_a_second_loss_is_a_clean_engine_closed() -> None:
    gone = rex.ActorUnavailableError("connection lost", None)
    handle = _Handle(submit_many=[rex.ActorDiedError(), gone])
    engine = _started(handle)
    with pytest.raises(EngineClosedError) as info:
        asyncio.run(engine.submit("photo", np.zeros(10, np.uint8)))
    assert info.value.code == "engine_closed" and info.value.detail["cause"] == "ActorUnavailableError"


def test_back_pressure_is_queue_full_and_engine_errors_keep_their_class() -> None:
    handle = _Handle(
        submit_many=[
            sex.BackPressureError(num_queued_requests=9, max_queued_requests=8),
            ("r1", [("err", error_to_wire(NoFaceError("no face")))]),
        ]
    )
    engine = _started(handle, retries=0)
    with pytest.raises(QueueFullError):
        asyncio.run(engine.submit("detect", np.zeros((4, 4, 3), np.uint8)))
    with pytest.raises(NoFaceError):
        asyncio.run(engine.submit("detect", np.zeros((4, 4, 3), np.uint8)))
    assert handle.submit_many.calls == 2  # neither is retried


def test_not_started_or_stopped_is_engine_closed() -> None:
    engine = RayEngine(_Handle())
    with pytest.raises(EngineClosedError):
        engine.start()
    asyncio.run(engine.astart())
    assert engine.start()["model"] == "sface" and engine.ready
    engine.stop()
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.submit("embed", np.zeros(1, np.uint8)))


def test_items_submitted_while_calls_are_in_flight_leave_together() -> None:
    """With ``max_calls`` calls out, the next items wait and go in one call; each gets its own answer."""
    gate = asyncio.Event()

    class _Slow(_Method):
        def remote(self, *args: Any) -> Any:
            self.calls += 1
            self.args.append(args)

            async def answer() -> Any:
                await gate.wait()
                return (f"r{self.calls}", [("ok", int(p[0])) for p in args[1]])

            return _Awaitable(answer())

    class _Awaitable(_Response):
        def __init__(self, coro: Any) -> None:
            super().__init__(None)
            self.coro = coro

        def __await__(self) -> Any:
            return self.coro.__await__()

    handle = _Handle()
    handle.submit_many = _Slow([])  # type: ignore[attr-defined]
    engine = _started(handle, max_calls=1)

    async def go() -> list[Any]:
        first = asyncio.ensure_future(engine.submit("photo", np.array([0], np.uint8)))
        await asyncio.sleep(0)  # the first call is out
        rest = [asyncio.ensure_future(engine.submit("photo", np.array([i], np.uint8))) for i in range(1, 6)]
        await asyncio.sleep(0.01)
        gate.set()
        return await asyncio.gather(first, *rest)

    assert asyncio.run(go()) == [0, 1, 2, 3, 4, 5]
    assert [len(a[1]) for a in handle.submit_many.args] == [1, 5]  # type: ignore[attr-defined]


def test_calls_go_by_value_unless_their_payloads_exceed_direct_max_bytes() -> None:
    """A call whose payloads fit DIRECT_MAX_BYTES goes by value; a larger one, whole, by reference."""
    direct = _Handle(submit_many=[("r1", [("ok", 1), ("ok", 2)])])
    handle = _Handle(direct=direct, submit_many=[("r2", [("ok", 3), ("ok", 4)])])
    engine = _started(handle)
    small, big = np.zeros(DIRECT_MAX_BYTES // 4, np.uint8), np.zeros(DIRECT_MAX_BYTES, np.uint8)

    async def together(*payloads: np.ndarray) -> list[Any]:
        return await asyncio.gather(*[engine.submit("detect", p) for p in payloads])

    assert asyncio.run(together(small, small)) == [1, 2]
    assert asyncio.run(together(small, big)) == [3, 4]
    assert handle.options_kw["_by_reference"] is False
    assert [len(a[1]) for a in direct.submit_many.args] == [2]  # type: ignore[attr-defined]
    assert [len(a[1]) for a in handle.submit_many.args] == [2]  # type: ignore[attr-defined]


class _Engine:
    """``enqueue`` as the engine does it: a full queue raises; otherwise the future settles later (or never)."""

    def __init__(self, outcomes: list[Any], request_timeout_s: float = 0.2) -> None:
        self.outcomes, self.request_timeout_s = outcomes, request_timeout_s
        self.items: list[Any] = []

    def enqueue(self, stage: str, payload: Any, future: asyncio.Future[Any]) -> Any:
        from facegate.engine.batcher import WorkItem

        outcome = self.outcomes.pop(0)
        if isinstance(outcome, QueueFullError):
            raise outcome
        item = WorkItem(payload, future, deadline=1e18)
        self.items.append(item)
        if outcome is not None:  # None: never computed
            future.get_loop().call_soon(future.set_result, outcome)
        return item


def test_an_engine_replica_answers_each_item_of_a_call() -> None:
    """One answer per item: results, the engine's own refusal, and the deadline for an item never computed
    (whose work item is then cancelled, so the engine skips it)."""
    from facegate.scaleout.ray_app import EngineReplica

    class _Replica(EngineReplica):
        def __del__(self) -> None:  # no service to stop (Serve awaits the real one's)
            pass

    replica = object.__new__(_Replica)
    engine = _Engine(["a", QueueFullError("full", retry_after_s=1.0), None, "d"])
    replica.service, replica.replica = type("S", (), {"engine": engine})(), "r0"  # type: ignore[assignment]
    rid, answers = asyncio.run(replica.submit_many("embed", [np.zeros(1, np.uint8)] * 4))
    assert rid == "r0"
    assert answers[0] == ("ok", "a") and answers[3] == ("ok", "d")
    assert answers[1][0] == "err" and type(answers[1][1]) is QueueFullError and answers[1][1].retry_after_s == 1.0
    assert answers[2][0] == "err" and type(answers[2][1]) is DeadlineExceededError
    assert engine.items[1].future.cancelled() and not engine.items[0].future.cancelled()


class _HostEngine:
    """``enqueue`` as EngineHost calls it (a concurrent future): answers ``stage:sum`` at once, or raises ``fail``."""

    request_timeout_s = 5.0

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.stages: list[str] = []

    def enqueue(self, stage: str, payload: np.ndarray, future: Any) -> Any:
        from facegate.engine.batcher import WorkItem

        if self.fail is not None:
            raise self.fail
        self.stages.append(stage)
        future.set_result(f"{stage}:{int(payload.sum())}")
        return WorkItem(payload, future, deadline=1e18)


@pytest.fixture
def engine_host(tmp_path: Any) -> Any:
    """An engine replica's Unix socket (EngineHost over a stand-in engine); yields ``(engine, info["local"])``."""
    import threading
    from multiprocessing.connection import Listener

    from facegate.scaleout.ray_engine import machine_id
    from facegate.transport.remote import EngineHost

    engine = _HostEngine()
    address, key = str(tmp_path / "engine.sock"), os.urandom(32)
    listener = Listener(address, family="AF_UNIX", authkey=key)
    service = type("S", (), {"engine": engine})()
    threading.Thread(target=EngineHost(service, {"model": "sface"}).serve, args=(listener,), daemon=True).start()
    yield engine, {"machine": machine_id(), "address": address, "authkey": key.hex()}
    listener.close()


def _local_handle(local: dict[str, Any], **methods: list[Any]) -> _Handle:
    handle = _Handle(**methods)
    handle.info = _Method([("r0", {"model": "sface", "local": local})])  # discovery's later calls fail
    return handle


def _submit_once(handle: _Handle, stage: str, payload: np.ndarray) -> tuple[Any, Served]:
    async def go() -> tuple[Any, Served]:
        engine = RayEngine(handle, local=True)
        await engine.astart()
        try:
            with record_replicas() as served:
                return await engine.submit(stage, payload), served
        finally:
            engine.stop()

    return asyncio.run(go())


def test_an_engine_replica_on_this_machine_is_reached_without_ray(engine_host: Any) -> None:
    host_engine, local = engine_host
    handle = _local_handle(local, submit_many=[])
    result, served = _submit_once(handle, "embed", np.ones(3, np.uint8))
    assert result == "embed:3" and host_engine.stages == ["embed"]
    assert handle.submit_many.calls == 0 and served.replicas == ["r0"] and served.retries == 0


def test_a_local_engine_that_stopped_is_resent_once_through_ray(engine_host: Any) -> None:
    host_engine, local = engine_host
    host_engine.fail = EngineClosedError("the engine is stopping")
    handle = _local_handle(local, submit_many=[("r1", [("ok", "via ray")])])
    result, served = _submit_once(handle, "photo", np.ones(3, np.uint8))
    assert result == "via ray" and handle.submit_many.calls == 1
    assert served.replicas == ["r1"] and served.retries == 1


def test_a_replica_of_another_machine_or_an_engine_error_stays_on_its_path(engine_host: Any) -> None:
    """Another machine's replica is called through Ray; a local engine's own refusal is the answer (no resend)."""
    host_engine, local = engine_host
    handle = _local_handle({**local, "machine": "elsewhere/0"}, submit_many=[("r1", [("ok", "via ray")])])
    assert _submit_once(handle, "embed", np.ones(3, np.uint8))[0] == "via ray"
    assert host_engine.stages == []
    host_engine.fail = QueueFullError("full", retry_after_s=1.0)
    handle = _local_handle(local, submit_many=[])
    with pytest.raises(QueueFullError):
        _submit_once(handle, "embed", np.ones(3, np.uint8))
    assert handle.submit_many.calls == 0
