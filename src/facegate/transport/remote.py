"""Engine processes fed by front-end processes through shared memory.

One engine process per GPU slot owns the device; front-ends reach it through a :class:`RemoteEngine` (the
engine's interface), writing payloads into their shared-memory :class:`Arena` (too large: inline) and sending
small pickled messages on an authenticated Unix socket. Errors come back as the same FacegateError subclass.

Front-end → engine: the arena's descriptor (``SCM_RIGHTS``), ``("hello", pid)``, ``("submit", rid,
stage, offset | None, shape, dtype, inline)``, ``("cancel", rid)``, ``("stats", rid)``. Engine → front-end:
``("hello", info)``, ``("batch", [("ok", rid, result) | ("err", rid, error), ...])`` (see :func:`error_to_wire`).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import mmap
import os
import queue
import random
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from facegate.config import Settings
from facegate.engine.batcher import AnyFuture, WorkItem, fail, settle
from facegate.errors import DeadlineExceededError, EngineClosedError, FacegateError, ModelError
from facegate.io.memcopy import copy_in, copy_out
from facegate.logs import configure_logging
from facegate.metrics.stats import ServiceStats
from facegate.tuning import ServingPlan

log = logging.getLogger(__name__)

#: How often a connection's sender fails items whose deadline passed while they were computing, in seconds.
_SWEEP_S = 0.5
#: Shared memory per front-end process: room for ~350 decoded 640×480 photos in flight.
ARENA_BYTES = 128 * 2**20
_ALIGN = 64
#: ``sys.setswitchinterval`` of the serving processes (default 5 ms): a thread waiting for the GIL, such as the
#: engine's device thread behind the connection threads, gets it within this.
SWITCH_INTERVAL_S = 0.001
#: An engine outlasts its front-ends' drain (Settings.drain_s) by this many seconds: their last answers need it.
ENGINE_DRAIN_MARGIN_S = 5.0


def error_to_wire(exc: BaseException) -> FacegateError:
    """``exc`` as it goes back to a front-end, pickled whole (detail and Retry-After included): a class of
    :mod:`facegate.errors` as it is, another FacegateError as a plain one (its module may import torch, which a
    front-end must not), anything else as a ModelError."""
    if type(exc).__module__ == FacegateError.__module__:
        return exc  # type: ignore[return-value]
    if isinstance(exc, FacegateError):
        return FacegateError(exc.message, detail=exc.detail)
    return ModelError(f"engine failure: {type(exc).__name__}: {exc}")


def outcome(result: Callable[[], Any], *head: Any) -> tuple[Any, ...]:
    """``("ok", *head, result())``, or ``("err", *head, error_to_wire(exc))`` if it raises (``result``: e.g. a done
    future's)."""
    try:
        return ("ok", *head, result())
    except BaseException as exc:  # every failure goes back to the caller
        return ("err", *head, error_to_wire(exc))


class Arena:
    """Thread-safe first-fit allocator over one front-end's ``memfd`` block (nothing outlives the processes, kill
    -9 included). Freed ranges are zeroed: a photo stays only while its request is in flight."""

    def __init__(self, size: int) -> None:
        # memfd: no path names it. The process model needs Unix SOCK_SEQPACKET (api.acceptor): Linux, which has it
        self.fd = os.memfd_create("facegate-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size)
        self.buf = memoryview(self._map)
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted by offset: (offset, length)
        self._lock = threading.Lock()

    @staticmethod
    def _round(n: int) -> int:
        return max(_ALIGN, (n + _ALIGN - 1) // _ALIGN * _ALIGN)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free range of ``nbytes`` (rounded up to 64), or ``None``."""
        n = self._round(nbytes)
        with self._lock:
            for i, (off, ln) in enumerate(self._free):
                if ln >= n:
                    self._free[i : i + 1] = [(off + n, ln - n)] if ln > n else []
                    return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Zero a range from :meth:`alloc` and give it back; neighbouring free ranges are merged."""
        n = self._round(nbytes)
        self._bytes[offset : offset + n] = 0  # no face stays in shared memory after its request
        with self._lock:
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, n))
            if i + 1 < len(self._free) and offset + n == self._free[i + 1][0]:  # merge with the next
                self._free[i] = (offset, n + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # merge with the previous
                prev, length = self._free[i - 1]
                self._free[i - 1] = (prev, length + self._free.pop(i)[1])

    def send_to(self, conn: Connection) -> None:
        """Pass the block's descriptor to the peer of ``conn`` (one byte with ``SCM_RIGHTS``)."""
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            socket.send_fds(sock, [b"m"], [self.fd])

    def close(self) -> None:
        """Unmap and close; not zeroed: the kernel frees the pages once the engine unmaps them too."""
        del self._bytes
        with contextlib.suppress(BufferError, ValueError):
            self.buf.release()
            self._map.close()
        os.close(self.fd)
        self.fd = -1


def receive(conn: Connection) -> mmap.mmap:
    """Map the whole block a front-end passed with :meth:`Arena.send_to`; the received descriptor is closed."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if len(fds) != 1:
        raise EOFError("the front-end closed the connection before passing its shared-memory block")
    try:
        return mmap.mmap(fds[0], 0)
    finally:
        os.close(fds[0])


class FrameReader:
    """A Connection's messages read from its socket in 1 MiB chunks, in its wire format (``recv`` makes two
    reads per message, each giving the GIL away; ``Connection`` buffers nothing, so nothing is lost)."""

    CHUNK = 1 << 20

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._buf = bytearray()

    def recv_many(self, limit: int = 1024) -> list[Any]:
        """Every complete message buffered (at most ``limit``), reading until there is one (EOFError: peer gone)."""
        out: list[Any] = []
        while True:
            self._parse(out, limit)
            if out:
                return out
            chunk = os.read(self._conn.fileno(), self.CHUNK)  # fileno() raises OSError once closed
            if not chunk:
                raise EOFError("the peer closed the connection")
            self._buf += chunk

    def _parse(self, out: list[Any], limit: int) -> None:
        buf, pos, end = self._buf, 0, len(self._buf)
        while len(out) < limit and end - pos >= 4:
            (size,) = struct.unpack_from("!i", buf, pos)
            head = 4
            if size == -1:
                if end - pos < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, pos + 4)
                head = 12
            if end - pos - head < size:
                break
            out.append(ForkingPickler.loads(buf[pos + head : pos + head + size]))
            pos += head + size
        if pos:
            del buf[:pos]


class EngineHost:
    """The engine process's side: feeds front-ends' payloads to a started FaceService; ``info`` answers hello."""

    def __init__(self, service: Any, info: dict[str, Any]) -> None:
        self.service = service
        self.info = info
        self.conns: set[Connection] = set()  # of the front-ends connected now

    def serve(self, listener: Listener) -> None:
        """Accept connections forever (run on a daemon thread); one reader thread per front-end."""
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return  # listener closed
            except Exception as exc:  # a failed authentication: keep serving the others
                log.warning("engine: refused a connection: %s", exc)
                continue
            threading.Thread(target=self._reader, args=(conn,), name="facegate-engine-conn", daemon=True).start()

    def _reader(self, conn: Connection) -> None:
        """Queue one front-end's payloads on the engine; its sender thread answers those done as one ``batch`` (no
        event-loop task per request)."""
        send_lock = threading.Lock()
        block: mmap.mmap | None = None
        pending: dict[int, WorkItem] = {}  # rid -> item, until answered
        done: queue.SimpleQueue[tuple[int, concurrent.futures.Future[Any]] | None] = queue.SimpleQueue()
        engine = self.service.engine

        def send(msg: tuple[Any, ...]) -> None:
            with send_lock, contextlib.suppress(OSError, ValueError):
                conn.send(msg)

        threading.Thread(
            target=self._sender, args=(done, pending, send), name="facegate-engine-send", daemon=True
        ).start()
        frames = FrameReader(conn)
        self.conns.add(conn)
        try:
            block = receive(conn)  # the arena's descriptor: the first byte after the handshake, read alone
            shm = memoryview(block)  # released with the block below
            while True:
                for msg in frames.recv_many():
                    if msg[0] == "submit":
                        _, rid, stage, offset, shape, dtype, inline = msg
                        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
                        try:
                            # copy_out holds the GIL: see memcopy
                            payload = inline if offset is None else copy_out(shm, offset, shape, dtype)
                            pending[rid] = engine.enqueue(stage, payload, fut)
                        except BaseException as exc:
                            send(("batch", [("err", rid, error_to_wire(exc))]))
                            continue
                        fut.add_done_callback(lambda f, rid=rid: done.put((rid, f)))
                    elif msg[0] == "cancel":  # the engine drops an item whose future is done unless it is computing
                        if (item := pending.get(msg[1])) is not None:
                            item.future.cancel()
                    elif msg[0] == "stats":
                        send(("batch", [outcome(self.service.stats.engine_samples, msg[1])]))
                    elif msg[0] == "hello":
                        log.info("engine: front-end pid %d connected", msg[1])
                        send(("hello", self.info))
        except (EOFError, OSError):
            log.info("engine: a front-end disconnected")
        finally:
            self.conns.discard(conn)
            for item in list(pending.values()):  # nobody waits for these any more
                item.cancel()
            done.put(None)
            if block is not None:
                with contextlib.suppress(Exception):
                    shm.release()
                    block.close()
            conn.close()

    @staticmethod
    def _sender(
        done: queue.SimpleQueue[tuple[int, concurrent.futures.Future[Any]] | None],
        pending: dict[int, WorkItem],
        send: Any,
    ) -> None:
        """Answer a connection's finished items in bursts; fail items still unanswered past their deadline."""
        last_sweep = time.monotonic()
        while True:
            got: list[tuple[int, concurrent.futures.Future[Any]] | None] = []
            with contextlib.suppress(queue.Empty):  # wait for one, then take every one already done
                got.append(done.get(timeout=_SWEEP_S))
                while True:
                    got.append(done.get_nowait())
            msgs: list[tuple[Any, ...]] = []
            for entry in got:
                if entry is None:
                    return
                rid, fut = entry
                pending.pop(rid, None)
                msgs.append(outcome(fut.result, rid))
            if msgs:
                send(("batch", msgs))
            now = time.monotonic()
            if now - last_sweep >= _SWEEP_S:  # e.g. a stage that never returns: answer at the deadline
                last_sweep = now
                for rid, item in list(pending.items()):
                    if now >= item.deadline:
                        fail([item], DeadlineExceededError(f"no result within the deadline (request {rid})"))


def engine_info(service: Any, t0: float, **extra: Any) -> dict[str, Any]:
    """An engine's answer to hello: model, operating thresholds, device, stages, seconds since ``t0``, ``extra``."""
    p = service.pipeline
    return {
        "model": p.spec.name,
        "operating": dataclasses.asdict(p.operating),
        "device": str(p.device),
        "stages": [st.name for st in p.stages()],
        "startup_s": round(time.perf_counter() - t0, 3),
        **extra,
    }


def engine_main(
    settings: Settings,
    plan: ServingPlan,
    address: str,
    authkey: bytes,
    ready: Connection,
    build: Callable[[Settings, ServingPlan], Any],
) -> None:
    """The engine process: ``build(settings, plan)`` the FaceService, listen on ``address``, serve until SIGTERM.
    Sends ``("ready", info)`` or ``("error", error_to_wire(exc))`` on ``ready`` once."""
    configure_logging()  # FACEGATE_LOG_LEVEL and FACEGATE_LOG_FORMAT, as the front-ends
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    t0 = time.perf_counter()
    try:
        service = build(settings, plan)
        build_s = time.perf_counter() - t0
        loop.run_until_complete(service.start())
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
    except BaseException as exc:  # reported to the supervisor, which exits non-zero
        log.exception("engine: startup failed")
        ready.send(("error", error_to_wire(exc)))
        return
    info = engine_info(service, t0, build_s=round(build_s, 3), warmup=service.pipeline.warmup_report)
    host = EngineHost(service, info)
    threading.Thread(target=host.serve, args=(listener,), name="facegate-engine-accept", daemon=True).start()
    grace_s = settings.drain_s + ENGINE_DRAIN_MARGIN_S
    first_signal: list[float] = []

    def on_signal() -> None:
        # The front-ends get a process-group signal too and finish their requests: serve until they have gone (at
        # most grace_s). A later signal stops at once; one within 0.5 s is the same one arriving twice.
        now = loop.time()
        if first_signal:
            if now - first_signal[0] > 0.5:
                loop.stop()
            return
        first_signal.append(now)
        if host.conns:
            log.info("engine: stopping once %d front-end(s) have gone (at most %.0f s)", len(host.conns), grace_s)
        poll(now + grace_s)

    def poll(deadline: float) -> None:
        if not host.conns or loop.time() >= deadline:
            loop.stop()
        else:
            loop.call_later(0.05, poll, deadline)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    supervisor = os.getppid()

    def watch_parent() -> None:  # the supervisor was killed outright: stop as on SIGTERM, not live on as an orphan
        if os.getppid() != supervisor:
            on_signal()
        else:
            loop.call_later(1.0, watch_parent)

    loop.call_later(1.0, watch_parent)
    log.info("engine ready in %.1f s on %s (%s)", info["startup_s"], address, info["device"])
    log.info("engine start-up: build %.1f s, warm-up %s", build_s, {k: v["seconds"] for k, v in info["warmup"].items()})
    ready.send(("ready", info))
    try:
        loop.run_forever()
    finally:
        listener.close()
        # once every front-end has gone nobody waits for queued work: fail it instead of computing it, so the
        # server's exit after a drain is not held up by a full queue
        service.engine.stop(drain=bool(host.conns))
        loop.run_until_complete(service.stop())
        log.info("engine stopped")


class RemoteEngine:
    """The engine interface over a connection to the engine process at Unix socket ``address``."""

    #: how long a refused connection is retried: a socket nobody listens on is a dead engine's
    refused_grace_s = 2.0

    def __init__(self, address: str, authkey: bytes, *, connect_timeout_s: float = 60.0) -> None:
        self.address = address
        self.authkey = authkey
        self.connect_timeout_s = connect_timeout_s
        self.info: dict[str, Any] = {}
        self._conn: Connection | None = None
        self._arena: Arena | None = None
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[asyncio.Future[Any], int | None, int]] = {}  # rid -> (future, arena slot)
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self.ready = False  # connected, and the engine process has not gone
        self._reader: threading.Thread | None = None

    def start(self) -> dict[str, Any]:
        """Connect (waiting ``connect_timeout_s`` for the socket), say hello, start the reader; the engine's info."""
        if self.ready:
            return self.info
        t0 = time.monotonic()
        while True:
            try:
                conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                limit = self.refused_grace_s if isinstance(exc, ConnectionRefusedError) else self.connect_timeout_s
                if time.monotonic() - t0 > limit:
                    raise EngineClosedError(f"no engine at {self.address}: {exc}") from None
                time.sleep(0.1)
        self._arena = Arena(ARENA_BYTES)
        self._arena.send_to(conn)
        conn.send(("hello", os.getpid()))
        _hello, info = conn.recv()  # the engine's first message: nothing else was sent yet
        self._conn, self.info, self.ready = conn, info, True
        self._reader = threading.Thread(target=self._read, name="facegate-remote-engine", daemon=True)
        self._reader.start()
        return info

    @property
    def in_flight(self) -> int:
        """Items sent to the engine process and not yet answered."""
        return len(self._pending)

    async def submit(self, stage: str, payload: np.ndarray) -> Any:
        """Run ``payload`` through the engine process's ``stage``; the result, or its FacegateError."""
        if not self.ready or self._conn is None or self._arena is None:
            raise EngineClosedError("the engine process is not connected")
        arr = np.ascontiguousarray(payload)
        rid = next(self._ids)
        offset = self._arena.alloc(arr.nbytes)
        if offset is not None:
            copy_in(self._arena.buf, offset, arr)
        msg = ("submit", rid, stage, offset, arr.shape, arr.dtype.str, arr if offset is None else None)
        try:
            return await self._send(msg, offset, arr.nbytes)
        except asyncio.CancelledError:  # the client went away: ask the engine to drop the item
            # the slot stays allocated until the engine answers (it may still be reading the payload)
            with contextlib.suppress(OSError, ValueError), self._send_lock:
                self._conn.send(("cancel", rid))
            raise

    def _send(self, msg: tuple[Any, ...], offset: int | None = None, nbytes: int = 0) -> asyncio.Future[Any]:
        """Register the future of request ``msg[1]`` (and its arena slot) and send ``msg``; a failed send settles it
        with EngineClosedError."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with self._pending_lock:
            self._pending[msg[1]] = (fut, offset, nbytes)
        try:
            with self._send_lock:
                self._conn.send(msg)  # type: ignore[union-attr]
        except (OSError, ValueError) as exc:
            self._settle_many([(msg[1], EngineClosedError(f"the engine process is gone: {exc}"), True)])
        return fut

    async def engine_samples(self) -> list[Any]:
        """The engine process's engine metric families (``ServiceStats.engine_samples``)."""
        if not self.ready or self._conn is None:
            raise EngineClosedError("the engine process is not connected")
        return await self._send(("stats", next(self._ids)))  # type: ignore[no-any-return]

    def _settle_many(self, results: list[tuple[int, Any, bool]]) -> None:
        """Free the slots and settle the futures of ``[(rid, value, is_error)]``, one wake-up per loop."""
        with self._pending_lock:
            entries = [(self._pending.pop(rid, None), value, error) for rid, value, error in results]
        settled: list[tuple[AnyFuture, bool, Any]] = []
        for entry, value, error in entries:
            if entry is None:
                continue
            fut, offset, nbytes = entry
            if offset is not None and self._arena is not None:
                self._arena.free(offset, nbytes)
            settled.append((fut, not error, value))
        settle(settled)

    def _read(self) -> None:
        assert self._conn is not None
        frames = FrameReader(self._conn)
        try:
            while True:
                for _batch, msgs in frames.recv_many():  # after hello the engine sends only ("batch", msgs)
                    self._settle_many([(rid, value, kind == "err") for kind, rid, value in msgs])
        except (EOFError, OSError):
            if self.ready:
                log.error("lost the connection to the engine process")
        finally:
            self.ready = False
            with self._pending_lock:
                rids = list(self._pending)
            self._settle_many([(rid, EngineClosedError("the engine process is gone"), True) for rid in rids])

    def stop(self, drain: bool = True) -> None:
        """Close the connection and the arena (in-flight requests fail with EngineClosedError); the engine process
        decides itself whether it drains."""
        self.ready = False
        if self._conn is not None:
            # shut the socket down first: close() alone neither wakes the reader thread blocked in read() nor,
            # while that read holds the socket, tells the engine this front-end has gone
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self._conn.close()
        if self._reader is not None:  # a daemon: a recv that close() does not wake is left behind
            self._reader.join(timeout=1.0)
        if self._arena is not None:
            self._arena.close()
            self._arena = None


#: The engine a request's items go to, inside :func:`same_engine` (a list shared by the request's tasks).
engine_affinity: contextvars.ContextVar[list[RemoteEngine] | None] = contextvars.ContextVar(
    "facegate_engine", default=None
)


@contextlib.contextmanager
def same_engine() -> Iterator[None]:
    """Send every item of the current request (and its tasks) to one engine process of a :class:`RemotePool`, so
    compare's answer does not wait for the slower of two engines."""
    token = engine_affinity.set([])
    try:
        yield
    finally:
        engine_affinity.reset(token)


def pick_engine(engines: Collection[RemoteEngine]) -> RemoteEngine | None:
    """The engine for the current request's next item: inside :func:`same_engine` the request's first one, else the
    live one with the fewest items in flight from here, at random among equals (so that an idle front-end still
    spreads its requests); None when none is live."""
    group = engine_affinity.get()
    if group and group[0] in engines and group[0].ready:
        return group[0]
    live = [e for e in engines if e.ready]
    if not live:
        return None
    fewest = min(e.in_flight for e in live)
    engine = random.choice([e for e in live if e.in_flight == fewest])
    if group is not None:
        group[:] = [engine]
    return engine


class RemotePool:
    """Several engine processes behind the engine interface: each request goes to the engine with the fewest
    requests in flight from this front-end."""

    def __init__(self, engines: list[RemoteEngine]) -> None:
        self.engines = engines
        self.info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        """Connect every engine; returns the first one's info (all serve the same model and thresholds)."""
        infos = [e.start() for e in self.engines]
        models = {i["model"] for i in infos}
        if len(models) != 1:
            raise ModelError(f"the engine processes serve different models: {sorted(models)}")
        self.info = {**infos[0], "devices": [i["device"] for i in infos]}
        return self.info

    @property
    def ready(self) -> bool:
        return all(e.ready for e in self.engines)

    async def submit(self, stage: str, payload: np.ndarray) -> Any:
        if (engine := pick_engine(self.engines)) is None:
            raise EngineClosedError("no engine process is connected")
        return await engine.submit(stage, payload)

    async def engine_samples(self) -> list[Any]:
        """The engines' metric families, summed (``ServiceStats.merge_samples``)."""
        return ServiceStats.merge_samples(await asyncio.gather(*[e.engine_samples() for e in self.engines]))

    def stop(self, drain: bool = True) -> None:
        for e in self.engines:
            e.stop(drain)
