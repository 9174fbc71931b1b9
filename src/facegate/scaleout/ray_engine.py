"""The engine interface of :class:`~facegate.transport.remote.RemoteEngine` over a Ray Serve handle (no torch).

A handle call costs CPU on each side, so items do not travel one per call: while ``max_calls`` calls of a stage
are in flight, new items wait and leave together. A call goes by value, on Serve's gRPC channel to the replica
(``_by_reference=False``, plain pickle): that costs about a third of the CPU of a Ray actor call, which passes
through Ray's task machinery and object references. A call whose payloads exceed ``DIRECT_MAX_BYTES`` (gRPC's
message limit is 4 MiB) goes by reference instead, through Ray's object store. Engine stages write nothing, so a
call whose replica died is sent once more to another; then :class:`EngineClosedError`. Serve's back-pressure is
:class:`QueueFullError`.

On the engine replica's own machine the items skip Ray altogether (``local``): each engine replica also listens
on a Unix socket (``facegate serve``'s engine transport, :class:`~facegate.transport.remote.RemoteEngine`: payloads
in shared memory, answers per item as their batch completes), and an ingress sends there when the replica's
``info`` names this machine. A Ray Serve call costs each side about a millisecond of CPU and several thread hops;
this path costs what a ``facegate serve`` front-end's does. Replicas on other machines, and any call whose local
engine went away, take the Ray path. Serve does not see the local calls: with autoscaling (which counts a
replica's ongoing Serve requests) the application keeps every call on Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import random
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from facegate.errors import EngineClosedError, QueueFullError
from facegate.transport.remote import RemoteEngine, engine_affinity, error_from_wire

log = logging.getLogger(__name__)

#: Payload bytes up to which a call goes by value: about where a call by value stops costing less CPU than one
#: by reference (``benchmarks/ray_calls.py``), and well under the 4 MiB that a replica's gRPC server accepts.
DIRECT_MAX_BYTES = 2 * 2**20
#: Seconds between two ``info`` calls through Serve that look for engine replicas on this machine (new ones after
#: a start, a replacement or a redeploy); each call reaches one replica, as Serve's router chooses.
DISCOVER_EVERY_S = 1.0
#: ``info`` calls at once at start-up: Serve's router spreads concurrent calls over the replicas.
DISCOVER_AT_START = 8


@functools.cache
def machine_id() -> str:
    """This machine: its host name and boot id (two containers of one host differ by host name)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        pass
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
    ``max_calls``: calls in flight per stage; ``max_items``: items per call; ``local``: send to the engine replicas
    of this machine through their Unix sockets.

    Items held back here wait for a call to come back, and reach the engine's queue in bursts, so that its batches
    form from fewer items; 12 calls per stage make that wait rarer than 4, and by value they cost about the CPU
    that 4 calls by reference did."""

    def __init__(
        self, handle: Any, *, retries: int = 1, max_calls: int = 12, max_items: int = 64, local: bool = False
    ) -> None:
        import grpc
        from ray import exceptions as rex
        from ray.serve import exceptions as sex

        self._handle = handle  # by reference: Ray actor calls, payloads through the object store
        self._direct = handle.options(
            _by_reference=False, request_serialization="pickle", response_serialization="pickle"
        )  # fmt: skip
        self.retries, self.max_calls, self.max_items = retries, max_calls, max_items
        self.info: dict[str, Any] = {}
        self._alive = False
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
        if not self._alive:
            _, replica, self.info = await self._call("info")
            self._alive = True
            if self.local:
                await self._connect_local(replica, self.info)
                await asyncio.gather(*[self._discover_one() for _ in range(DISCOVER_AT_START)])
                self._discovery = asyncio.get_running_loop().create_task(self._discover())
        return self.info

    async def _discover(self) -> None:
        """Forever: drop the local connections that broke, and look for another engine replica."""
        while self._alive:
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
        if replica in self._seen or not self._alive:
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
        if not self._alive:
            engine.stop()
            return
        self._local[engine] = replica
        log.info("engine replica %s: local connection in %.0f ms", replica, 1000 * (time.perf_counter() - t0))

    def _pick_local(self) -> RemoteEngine | None:
        """The local engine for the next item (RemotePool's choice, made here because the answer's headers name the
        replica picked): the request's own (``same_engine``, as a RemotePool's), else the
        one with the fewest items in flight from here, at random among equals (as Serve's router: when this
        ingress is idle its requests still spread over the replicas); None when no local connection is up."""
        group = engine_affinity.get()
        if group and group[0] in self._local and group[0].ready:
            return group[0]
        live = [e for e in self._local if e.ready]
        if not live:
            return None
        fewest = min(e.in_flight for e in live)
        engine = random.choice([e for e in live if e.in_flight == fewest])
        if group is not None:
            group[:] = [engine]
        return engine

    def start(self) -> dict[str, Any]:
        """The info from :meth:`astart` (which the ingress awaits before it builds the app)."""
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
        resent = 0
        if (engine := self._pick_local()) is not None:
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
            replica, retries, (kind, *rest) = await entry[1]
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                pending.remove(entry)
            raise
        if (served := _served.get()) is not None:
            served.replicas.append(replica)
            served.retries += retries + resent
        if kind == "ok":
            return rest[0]
        raise error_from_wire(*rest)

    def _flush(self, stage: str) -> None:
        pending = self._pending[stage]
        if pending and self._in_flight[stage] < self.max_calls:
            batch, pending[: self.max_items] = pending[: self.max_items], []
            self._in_flight[stage] += 1
            direct = sum(payload.nbytes for payload, _ in batch) <= DIRECT_MAX_BYTES
            asyncio.get_running_loop().create_task(self._send(stage, batch, direct))

    async def _send(self, stage: str, batch: list[tuple[np.ndarray, asyncio.Future[Any]]], direct: bool) -> None:
        try:
            handle = self._direct if direct else self._handle
            retries, replica, answers = await self._call("submit_many", stage, [p for p, _ in batch], handle=handle)
            for (_, fut), answer in zip(batch, answers, strict=True):
                if not fut.done():
                    fut.set_result((replica, retries, answer))
        except Exception as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
        finally:
            self._in_flight[stage] -= 1
            self._flush(stage)

    async def engine_samples(self) -> dict[str, list[Any]]:
        """One engine replica's samples of the engine metric families (see ``ServiceStats.engine_samples``)."""
        return (await self._call("engine_samples"))[2]

    async def _call(self, method: str, *args: Any, handle: Any = None) -> tuple[int, str, Any]:
        """``(retries, replica, result)`` of ``method`` on an engine replica (through ``handle``: by reference)."""
        from ray.serve.exceptions import BackPressureError

        attempt = 0
        while True:
            response = getattr(self._handle if handle is None else handle, method).remote(*args)
            try:
                kind, replica, *rest = await response
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
                attempt += 1
                log.warning("engine replica lost during %s (%s); retrying on another", method, type(exc).__name__)
                continue
            if kind == "ok":
                return attempt, replica, rest[0]
            raise error_from_wire(*rest)

    def stop(self, drain: bool = True, *, timeout_s: float | None = 10.0) -> None:
        """Stop sending and close the local connections (the replicas belong to Ray Serve and stay up)."""
        self._alive = False
        if self._discovery is not None:  # from any thread (FaceService.stop calls this on an executor's)
            with contextlib.suppress(RuntimeError):  # its loop has closed
                self._discovery.get_loop().call_soon_threadsafe(self._discovery.cancel)
        for engine in list(self._local):
            engine.stop(drain, timeout_s=timeout_s)
        self._local.clear()
