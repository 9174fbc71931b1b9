"""RayEngine's failure mapping: a lost replica is retried once, then 503; Serve's back-pressure is queue_full.

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

from facegate.errors import EngineClosedError, NoFaceError, QueueFullError
from facegate.scaleout.ray_engine import RayEngine, Served, record_replicas
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

    def remote(self, *args: Any) -> _Response:
        self.calls += 1
        return _Response(self.outcomes.pop(0))


class _Handle:
    def __init__(self, **methods: list[Any]) -> None:
        self.info = _Method([("ok", "r0", {"model": "sface"})])
        for name, outcomes in methods.items():
            setattr(self, name, _Method(outcomes))


def _started(handle: _Handle, **kw: Any) -> RayEngine:
    engine = RayEngine(handle, **kw)
    asyncio.run(engine.astart())
    return engine


def test_a_lost_replica_is_retried_on_another() -> None:
    handle = _Handle(submit=[rex.ActorDiedError(), ("ok", "r2", "embedding")])
    engine = _started(handle)

    async def go() -> tuple[Any, Served]:
        with record_replicas() as served:
            return await engine.submit("embed", np.zeros((1, 112, 112, 3), np.uint8)), served

    result, served = asyncio.run(go())
    assert result == "embedding" and served.replicas == ["r2"] and served.retries == 1 and handle.submit.calls == 2


def test_a_second_loss_is_a_clean_engine_closed() -> None:
    gone = rex.ActorUnavailableError("connection lost", None)
    handle = _Handle(submit=[rex.ActorDiedError(), gone])
    engine = _started(handle)
    with pytest.raises(EngineClosedError) as info:
        asyncio.run(engine.submit("photo", np.zeros(10, np.uint8)))
    assert info.value.code == "engine_closed" and info.value.detail["cause"] == "ActorUnavailableError"


def test_back_pressure_is_queue_full_and_engine_errors_keep_their_class() -> None:
    handle = _Handle(
        submit=[
            sex.BackPressureError(num_queued_requests=9, max_queued_requests=8),
            ("err", "r1", *error_to_wire(NoFaceError("no face"))),
        ]
    )
    engine = _started(handle, retries=0)
    with pytest.raises(QueueFullError):
        asyncio.run(engine.submit("detect", np.zeros((4, 4, 3), np.uint8)))
    with pytest.raises(NoFaceError):
        asyncio.run(engine.submit("detect", np.zeros((4, 4, 3), np.uint8)))
    assert handle.submit.calls == 2  # neither is retried


def test_not_started_or_stopped_is_engine_closed() -> None:
    engine = RayEngine(_Handle())
    with pytest.raises(EngineClosedError):
        engine.start()
    asyncio.run(engine.astart())
    assert engine.start()["model"] == "sface" and engine.ready
    engine.stop()
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.submit("embed", np.zeros(1, np.uint8)))
