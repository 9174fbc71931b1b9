"""The engine interface over a Ray Serve handle: what a front-end (the Ray ingress) talks to.

:class:`RayEngine` has the small interface of :class:`~facegate.transport.remote.RemoteEngine`
(``start``, ``ready``, ``submit``, ``engine_samples``, ``stop``), so a
:class:`~facegate.service.faces.FaceService` and the HTTP routes use it unchanged. Each ``submit`` is one
call to the engine deployment (:class:`~facegate.scaleout.ray_app.EngineReplica`), which puts the payload on
its own batching :class:`~facegate.engine.engine.Engine`; Ray's router picks the replica.

Failures. Every engine stage is a pure function of its payload (decode, detect, embed): nothing is written
in an engine, so a call whose replica died (its actor is gone, or unreachable) is retried once on another
replica. If that fails too, or no replica is up, the call raises :class:`EngineClosedError` (HTTP 503);
Ray Serve's back-pressure (every replica at ``max_ongoing_requests`` and the queue full) raises
:class:`QueueFullError` (503 with Retry-After). Gallery writes happen in the front-end, after the engine
answered: a replica's death can fail an enrolment, never lose an acknowledged one.

The module imports no torch: it runs in front-end processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from facegate.errors import EngineClosedError, QueueFullError
from facegate.transport.remote import error_from_wire

log = logging.getLogger(__name__)


@dataclass
class Served:
    """The engine replicas that answered a request's calls, and how many calls were sent again."""

    replicas: list[str] = field(default_factory=list)
    retries: int = 0


#: What the current request's engine calls did, inside :func:`record_replicas`.
_served: contextvars.ContextVar[Served | None] = contextvars.ContextVar("facegate_ray_served", default=None)


@contextlib.contextmanager
def record_replicas() -> Iterator[Served]:
    """Record which engine replicas answer the calls made inside the block (and its tasks), and the retries."""
    served = Served()
    token = _served.set(served)
    try:
        yield served
    finally:
        _served.reset(token)


def _replica_gone_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors for a call whose replica died or could not be reached (retried: engine calls are pure)."""
    from ray import exceptions as rex
    from ray.serve import exceptions as sex

    return (rex.RayActorError, rex.ActorUnavailableError, sex.ReplicaUnavailableError)


class RayEngine:
    """The engine interface over a :class:`ray.serve.handle.DeploymentHandle` to the engine deployment.

    Args:
        handle: the engine deployment's handle (what ``.bind()`` passed to the ingress).
        retries: how many more times a call whose replica died is sent again (another replica takes it).
    """

    def __init__(self, handle: Any, *, retries: int = 1) -> None:
        self._handle = handle
        self.retries = retries
        self.info: dict[str, Any] = {}
        self._alive = False
        self._gone = _replica_gone_errors()

    async def astart(self) -> dict[str, Any]:
        """Ask one replica for the engine's info (model, operating thresholds, device, stages)."""
        if not self._alive:
            self.info = await self._call("info")
            self._alive = True
        return self.info

    def start(self) -> dict[str, Any]:
        """The info from :meth:`astart` (the ingress starts the client on its event loop, before the app)."""
        if not self._alive:
            raise EngineClosedError("the Ray engine client was not started (RayEngine.astart)")
        return self.info

    @property
    def ready(self) -> bool:
        return self._alive

    async def submit(self, stage: str, payload: np.ndarray) -> Any:
        """Run ``payload`` through an engine replica's ``stage``; the result, or its FacegateError."""
        if not self._alive:
            raise EngineClosedError("the Ray engine client is stopped")
        return await self._call("submit", stage, np.ascontiguousarray(payload))

    async def engine_samples(self) -> dict[str, list[Any]]:
        """One engine replica's samples of the engine metric families (see ``ServiceStats.engine_samples``)."""
        return await self._call("engine_samples")

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.serve.exceptions import BackPressureError

        attempt = 0
        while True:
            response = getattr(self._handle, method).remote(*args)
            try:
                kind, replica, *rest = await response
            except asyncio.CancelledError:  # the client went away: the replica's task is cancelled too
                response.cancel()
                raise
            except BackPressureError as exc:
                raise QueueFullError(f"every engine replica is busy: {exc}", retry_after_s=1.0) from None
            except self._gone as exc:
                if attempt < self.retries:
                    attempt += 1
                    if (served := _served.get()) is not None:
                        served.retries += 1
                    log.warning("engine replica lost during %s (%s); retrying on another", method, type(exc).__name__)
                    continue
                raise EngineClosedError(
                    "the engine replica serving this request is gone", detail={"cause": type(exc).__name__}
                ) from None
            if (served := _served.get()) is not None:
                served.replicas.append(replica)
            if kind == "ok":
                return rest[0]
            raise error_from_wire(*rest)

    def stop(self, drain: bool = True, *, timeout_s: float | None = 10.0) -> None:
        """Stop sending (the replicas belong to Ray Serve and stay up)."""
        self._alive = False
