"""The engine interface of :class:`~facegate.transport.remote.RemoteEngine` over a Ray Serve handle (no torch).

A handle call costs CPU on each side, so while ``max_calls`` calls of a stage are in flight new items wait and
leave together. A call goes by value on Serve's gRPC channel (``_by_reference=False``, plain pickle: less CPU than
a Ray actor call), or by reference through the object store when its payloads exceed ``DIRECT_MAX_BYTES``. Engine
stages write nothing, so a call whose replica died is sent once more; then :class:`EngineClosedError`. Serve's
back-pressure is :class:`QueueFullError`. With ``local``, items for an engine replica on this machine skip Ray and
go through its Unix socket (``facegate serve``'s transport); Serve does not see those calls, so with autoscaling
(which counts them) the application keeps every call on Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from facegate.engine.batcher import set_asyncio_many
from facegate.errors import EngineClosedError, QueueFullError
from facegate.transport.remote import RemoteEngine, pick_engine

log = logging.getLogger(__name__)

#: Payload bytes up to which a call goes by value (it costs less CPU below; a replica's gRPC server takes 4 MiB).
DIRECT_MAX_BYTES = 2 * 2**20
#: Seconds between two ``info`` calls through Serve that look for engine replicas on this machine (new ones after
#: a start, a replacement or a redeploy); each call reaches one replica, as Serve's router chooses.
DISCOVER_EVERY_S = 1.0
#: ``info`` calls at once at start-up: Serve's router spreads concurrent calls over the replicas.
DISCOVER_AT_START = 8
#: Items per handle call.
MAX_ITEMS = 64


@functools.cache
def machine_id() -> str:
    """This machine: its host name and boot id (two containers of one host differ by host name)."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as fh:
        boot = fh.read().strip()
    return f"{socket.gethostname()}/{boot}"


@dataclass
class Served:
    """The engine replicas that answered a request's calls, and how many calls were sent again."""

    replicas: list[str] = field(default_factory=list)
    retries: int = 0


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


class RayEngine:
    """The engine over the engine deployment's ``handle``; ``retries``: resends of a call whose replica died;
    ``max_calls``: calls in flight per stage; ``local``: reach the engine replicas of this machine by Unix socket."""

    def __init__(self, handle: Any, *, retries: int = 1, max_calls: int = 12, local: bool = False) -> None:
        import grpc
        from ray import exceptions as rex
        from ray.serve import exceptions as sex

        self._handle = handle  # by reference: Ray actor calls, payloads through the object store
        self._direct = handle.options(
            _by_reference=False, request_serialization="pickle", response_serialization="pickle"
        )  # fmt: skip
        self.retries, self.max_calls = retries, max_calls
        self.info: dict[str, Any] = {}
        self.ready = False  # started (astart), not stopped
        # a by-value call to a replica that died ends as gRPC UNAVAILABLE (Serve: ActorUnavailableError) or
        # another gRPC status, depending on when the connection broke
        self._gone = (rex.RayActorError, rex.ActorUnavailableError, sex.ReplicaUnavailableError, grpc.aio.AioRpcError)
        self._pending: defaultdict[str, list[tuple[np.ndarray, asyncio.Future[Any]]]] = defaultdict(list)
        self._in_flight: defaultdict[str, int] = defaultdict(int)
        self.local = local
        #: connections to the engine replicas of this machine, and the replica each one reaches
        self._local: dict[RemoteEngine, str] = {}
        self._seen: set[str] = set()  # replicas already looked at (local or not)
        self._discovery: asyncio.Task[None] | None = None

    async def astart(self) -> dict[str, Any]:
        """Ask one replica for the engine's info (model, operating thresholds, device, stages)."""
        if not self.ready:
            _, replica, self.info = await self._call("info")
            self.ready = True
            if self.local:
                await self._connect_local(replica, self.info)
                await asyncio.gather(*[self._discover_one() for _ in range(DISCOVER_AT_START)])
                self._discovery = asyncio.get_running_loop().create_task(self._discover())
        return self.info

    async def _discover(self) -> None:
        """Forever: drop the local connections that broke, and look for another engine replica."""
        while self.ready:
            await asyncio.sleep(DISCOVER_EVERY_S)
            for engine, replica in list(self._local.items()):
                if not engine.ready:
                    log.info("engine replica %s: its local connection is gone", replica)
                    del self._local[engine]
                    engine.stop()
            await self._discover_one()

    async def _discover_one(self) -> None:
        try:
            _, replica, info = await self._call("info")
        except Exception as exc:  # replicas being replaced: the next round asks again
            log.debug("engine discovery: %s", exc)
            return
        await self._connect_local(replica, info)

    async def _connect_local(self, replica: str, info: dict[str, Any]) -> None:
        """Connect to ``replica``'s Unix socket if it is on this machine (once per replica)."""
        local = info.get("local")
        if replica in self._seen or not self.ready:
            return
        self._seen.add(replica)
        if not local or local.get("machine") != machine_id():
            return
        engine = RemoteEngine(local["address"], bytes.fromhex(local["authkey"]), connect_timeout_s=2.0)
        t0 = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.start)
        except Exception as exc:  # another file system (a container) or a replica that just stopped: Ray path
            log.info("engine replica %s: no local connection (%s); calls go through Ray Serve", replica, exc)
            engine.stop()
            return
        if not self.ready:
            engine.stop()
            return
        self._local[engine] = replica
        log.info("engine replica %s: local connection in %.0f ms", replica, 1000 * (time.perf_counter() - t0))

    def start(self) -> dict[str, Any]:
        """The info from :meth:`astart` (which the ingress awaits before it builds the app)."""
        if not self.ready:
            raise EngineClosedError("the Ray engine client was not started (RayEngine.astart)")
        return self.info

    async def submit(self, stage: str, payload: np.ndarray) -> Any:
        """Run ``payload`` through an engine replica's ``stage``; the result, or its FacegateError."""
        if not self.ready:
            raise EngineClosedError("the Ray engine client is stopped")
        resent = 0
        if (engine := pick_engine(self._local)) is not None:  # picked here: the answer's headers name the replica
            replica = self._local.get(engine, "")
            try:
                result = await engine.submit(stage, payload)
            except EngineClosedError:  # the replica stopped or died: engine stages write nothing, so once via Ray
                log.warning("engine replica %s lost during %s; sending through Ray Serve", replica, stage)
                resent = 1
            else:
                if (served := _served.get()) is not None:
                    served.replicas.append(replica)
                return result
        loop = asyncio.get_running_loop()
        entry = (np.ascontiguousarray(payload), loop.create_future())
        pending = self._pending[stage]
        pending.append(entry)
        if len(pending) == 1:  # sent after this turn's other submits, outside this request's context
            loop.call_soon(self._flush, stage, context=contextvars.Context())
        try:
            replica, retries, (kind, value) = await entry[1]
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                pending.remove(entry)
            raise
        if (served := _served.get()) is not None:
            served.replicas.append(replica)
            served.retries += retries + resent
        if kind == "ok":
            return value
        raise value

    def _flush(self, stage: str) -> None:
        pending = self._pending[stage]
        if pending and self._in_flight[stage] < self.max_calls:
            batch, pending[:MAX_ITEMS] = pending[:MAX_ITEMS], []
            self._in_flight[stage] += 1
            handle = self._direct if sum(payload.nbytes for payload, _ in batch) <= DIRECT_MAX_BYTES else self._handle
            asyncio.get_running_loop().create_task(self._send(stage, batch, handle))

    async def _send(self, stage: str, batch: list[tuple[np.ndarray, asyncio.Future[Any]]], handle: Any) -> None:
        try:
            retries, replica, answers = await self._call("submit_many", stage, [p for p, _ in batch], handle=handle)
            set_asyncio_many([(fut, True, (replica, retries, a)) for (_, fut), a in zip(batch, answers, strict=True)])
        except Exception as exc:
            set_asyncio_many([(fut, False, exc) for _, fut in batch])
        finally:
            self._in_flight[stage] -= 1
            self._flush(stage)

    async def engine_samples(self) -> list[Any]:
        """One engine replica's engine metric families (``ServiceStats.engine_samples``)."""
        return (await self._call("engine_samples"))[2]

    async def _call(self, method: str, *args: Any, handle: Any = None) -> tuple[int, str, Any]:
        """``(retries, replica, result)`` of ``method`` on an engine replica (through ``handle``: by reference)."""
        from ray.serve.exceptions import BackPressureError

        for attempt in itertools.count():
            response = getattr(self._handle if handle is None else handle, method).remote(*args)
            try:
                replica, result = await response
            except asyncio.CancelledError:  # the caller went away: the replica's task is cancelled too
                response.cancel()
                raise
            except BackPressureError as exc:
                raise QueueFullError(f"every engine replica is busy: {exc}", retry_after_s=1.0) from None
            except self._gone as exc:
                if attempt == self.retries:
                    raise EngineClosedError(
                        "the engine replica serving this request is gone", detail={"cause": type(exc).__name__}
                    ) from None
                log.warning("engine replica lost during %s (%s); retrying on another", method, type(exc).__name__)
                continue
            return attempt, replica, result

    def stop(self, drain: bool = True) -> None:
        """Stop sending and close the local connections (the replicas belong to Ray Serve and stay up)."""
        self.ready = False
        if self._discovery is not None:  # from any thread (FaceService.stop calls this on an executor's)
            with contextlib.suppress(RuntimeError):  # its loop has closed
                self._discovery.get_loop().call_soon_threadsafe(self._discovery.cancel)
        for engine in list(self._local):
            engine.stop(drain)
        self._local.clear()
