"""Overload measurement: capacity in a closed loop, then an open loop at a multiple of it (a fixed rate whatever the
answers, latency from each request's scheduled time, so a client falling behind shows as latency).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rawhttp import FilePart, RawClient, TransportError, encode_multipart, encode_request


def _pct(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


@dataclass
class Phase:
    """Counts and latencies (seconds) of one phase; ``seconds``: the sending window, ``elapsed_s``: until the last
    answer."""

    seconds: float
    elapsed_s: float = 0.0
    sent: int = 0
    ok: list[float] = field(default_factory=list)
    shed: list[float] = field(default_factory=list)
    other: collections.Counter[str] = field(default_factory=collections.Counter)
    non_json: int = 0
    client_cpu_s: float = 0.0
    max_lag_s: float = 0.0
    bounds: list[int] = field(default_factory=list)  # the admission bound each 503 overloaded names
    shed_from_send: list[float] = field(default_factory=list)  # 503 latency from the write, not the schedule
    shed_due: list[float] = field(default_factory=list)  # each 503's scheduled time, seconds into the phase
    ok_due: list[float] = field(default_factory=list)  # each 2xx's scheduled time, seconds into the phase

    def add(self, other: Phase) -> None:
        names = ("sent", "ok", "shed", "other", "non_json", "bounds", "shed_from_send", "shed_due", "ok_due")
        for name in (*names, "client_cpu_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))  # counts add, lists and Counters join
        self.max_lag_s = max(self.max_lag_s, other.max_lag_s)
        self.elapsed_s = max(self.elapsed_s, other.elapsed_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 2),
            "elapsed_s": round(self.elapsed_s, 2),
            "sent": self.sent,
            "sent_per_s": round(self.sent / self.seconds, 1),
            "ok": len(self.ok),
            "shed_503": len(self.shed),
            "other": dict(self.other),
            "non_json": self.non_json,
            "ok_per_s": round(len(self.ok) / max(self.elapsed_s, self.seconds), 2),
            "ok_p50_s": _pct(self.ok, 0.50),
            "ok_p99_s": _pct(self.ok, 0.99),
            "ok_max_s": max(self.ok) if self.ok else None,
            "shed_p50_s": _pct(self.shed, 0.50),
            "shed_p99_s": _pct(self.shed, 0.99),
            "shed_p99_from_send_s": _pct(self.shed_from_send, 0.99),  # without the client's own lag
            **self._shed_windows(),
            "bound_p10_p50_p90": [_pct(self.bounds, q) for q in (0.1, 0.5, 0.9)],
            "client_cpu_s": round(self.client_cpu_s, 2),
            "client_cpu_cores": round(self.client_cpu_s / self.seconds, 3),
            "client_max_lag_s": round(self.max_lag_s, 4),
        }

    def _shed_windows(self, width_s: float = 5.0) -> dict[str, Any]:
        """The 503s' p99 latency from the send by window of scheduled time, and after the first window (the
        connection ramp): whether slow refusals come from the start of the flood or from all of it. The first
        window also by second, and the 2xx per second by window: how soon the bound settles."""
        if not self.shed_due or len(self.shed_due) != len(self.shed_from_send):
            return {}
        windows: dict[int, list[float]] = collections.defaultdict(list)
        seconds: dict[int, list[float]] = collections.defaultdict(list)
        for due, s in zip(self.shed_due, self.shed_from_send, strict=True):
            windows[int(due // width_s)].append(s)
            if due < width_s:
                seconds[int(due)].append(s)
        after = [s for due, s in zip(self.shed_due, self.shed_from_send, strict=True) if due >= width_s]
        ok = collections.Counter(int(due // width_s) for due in self.ok_due)
        return {
            "shed_p99_from_send_by_5s": [_pct(windows[i], 0.99) for i in range(max(windows) + 1)],
            "shed_p99_from_send_first_5s_by_1s": [_pct(seconds[i], 0.99) for i in range(int(width_s))],
            "shed_p99_from_send_after_5s": _pct(after, 0.99),
            "ok_per_s_by_5s": [round(ok[i] / width_s, 1) for i in range(max(windows) + 1)],
        }


def encode(url: str, path: str, files: list[FilePart]) -> bytes:
    """A ``POST path`` with ``files`` as multipart, ready to write to ``url``'s server."""
    body, ctype = encode_multipart(None, files)
    return encode_request("POST", RawClient(url).host_header, path, body=body, content_type=ctype)


def _record(
    phase: Phase,
    status: int | str,
    body: bytes,
    seconds: float,
    sent_s: float | None = None,
    due_s: float | None = None,
) -> None:
    phase.sent += 1
    if isinstance(status, int):
        try:
            answer = json.loads(body)
        except ValueError:
            phase.non_json += 1
        else:
            if status == 503 and isinstance(answer, dict):
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    phase.bounds.append(int(answer["error"]["detail"]["limit"]))
    if 200 <= (status if isinstance(status, int) else 0) < 300:
        phase.ok.append(seconds)
        if due_s is not None:
            phase.ok_due.append(due_s)
    elif status == 503:
        phase.shed.append(seconds)
        if sent_s is not None and due_s is not None:
            phase.shed_from_send.append(sent_s)
            phase.shed_due.append(due_s)
    else:
        phase.other[str(status)] += 1


async def _one(client: RawClient, data: bytes, phase: Phase, t0: float) -> None:
    try:
        r = await client.request(data)
        status: int | str = r.status_code
        body = r.content
    except TransportError as exc:
        status, body = type(exc).__name__, b""
    _record(phase, status, body, time.perf_counter() - t0)


async def closed_loop(url: str, data: bytes, *, concurrency: int, seconds: float) -> Phase:
    """``concurrency`` back-to-back clients for ``seconds``; a client told 503 pauses 50 ms."""
    phase = Phase(seconds)
    cpu0 = time.process_time()
    end = time.perf_counter() + seconds
    async with RawClient(url, timeout_s=120.0) as client:

        async def worker() -> None:
            while time.perf_counter() < end:
                shed = len(phase.shed)
                await _one(client, data, phase, time.perf_counter())
                if len(phase.shed) > shed:
                    await asyncio.sleep(0.05)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        phase.elapsed_s = time.perf_counter() - t0
    phase.client_cpu_s = time.process_time() - cpu0
    return phase


class _Link(asyncio.Protocol):
    """One keep-alive connection of :func:`open_loop`, answered by callbacks (a task per request costs too much)."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.due: float | None = None  # the request in progress: its scheduled time
        self.sent_at = 0.0  # ... and when it was written
        self.answered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.pool.idle(self)

    def send(self, due: float) -> None:
        assert self.transport is not None
        self.due, self.sent_at = due, time.perf_counter()
        self.transport.write(self.pool.data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.due is None:
            return
        head = self.buf[:end].lower()
        i = head.find(b"\r\ncontent-length:")
        n = int(head[i + 17 :].split(b"\r\n", 1)[0]) if i >= 0 else 0
        if len(self.buf) < end + 4 + n:
            return
        body, self.buf = self.buf[end + 4 : end + 4 + n], self.buf[end + 4 + n :]
        due, self.due = self.due, None
        self.answered += 1
        self.pool.answered(int(head[9:12]), body, due, self.sent_at)
        if b"\r\nconnection: close" in head:
            assert self.transport is not None
            self.transport.close()
        else:
            self.pool.idle(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.lost(self)


class _Pool:
    """The connections of one :func:`open_loop` and what they answered (into ``phase``)."""

    def __init__(self, host: str, port: int, data: bytes, phase: Phase, max_open: int) -> None:
        self.host, self.port, self.data, self.phase, self.max_open = host, port, data, phase, max_open
        self.free: list[_Link] = []
        self.waiting: collections.deque[float] = collections.deque()  # scheduled times with no connection yet
        self.open = 0
        self.busy = 0
        self.t0 = time.perf_counter()  # the phase's start, which open_loop sets

    def request(self, due: float) -> None:
        self.busy += 1
        if self.free:
            self.free.pop().send(due)
            return
        self.waiting.append(due)
        if self.open < self.max_open:
            self.open += 1
            asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        try:
            await asyncio.get_running_loop().create_connection(lambda: _Link(self), self.host, self.port)
        except OSError:
            self.open -= 1
            if self.waiting:
                self.waiting.popleft()
                self._done("ConnectError")

    def idle(self, link: _Link) -> None:
        if self.waiting:
            link.send(self.waiting.popleft())
        else:
            self.free.append(link)

    def lost(self, link: _Link) -> None:
        self.open -= 1
        if link in self.free:
            self.free.remove(link)
        if link.due is not None and link.answered and not link.buf:
            self.waiting.appendleft(link.due)  # a kept-alive connection the server had closed: retry, as httpx does
        elif link.due is not None:
            self._done("RemoteProtocolError")
        if self.waiting and self.open < self.max_open:  # requests that waited for this connection
            self.open += 1
            asyncio.get_running_loop().create_task(self._connect())

    def answered(self, status: int, body: bytes, due: float, sent_at: float) -> None:
        now = time.perf_counter()
        _record(self.phase, status, body, now - due, now - sent_at, due - self.t0)
        self.busy -= 1

    def _done(self, error: str) -> None:
        self.phase.sent += 1
        self.phase.other[error] += 1
        self.busy -= 1


async def open_loop(url: str, data: bytes, *, rate: float, seconds: float, max_open: int = 4000) -> Phase:
    """Requests at ``rate`` per second for ``seconds``, whatever the answers, each on its own connection (at most
    ``max_open``; the wait for one counts as latency)."""
    phase = Phase(seconds)
    cpu0 = time.process_time()
    client = RawClient(url)
    pool = _Pool(client.host, client.port, data, phase, max_open)
    t0 = pool.t0 = time.perf_counter()
    n = 0
    while (now := time.perf_counter()) < t0 + seconds:
        while n < int((now - t0) * rate) + 1:
            due = t0 + n / rate
            phase.max_lag_s = max(phase.max_lag_s, now - due)
            pool.request(due)
            n += 1
        await asyncio.sleep(0.001)
    while pool.busy > 0 and time.perf_counter() - t0 < seconds + 120:
        await asyncio.sleep(0.005)
    phase.elapsed_s = time.perf_counter() - t0
    for link in pool.free:
        if link.transport is not None:
            link.transport.close()
    phase.client_cpu_s = time.process_time() - cpu0
    return phase


def _child(url: str, data: bytes, rate: float, seconds: float, start_at: float) -> Phase:
    """One client process of :func:`open_loop_procs` (with uvloop where installed)."""
    time.sleep(max(0.0, start_at - time.time()))
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(open_loop(url, data, rate=rate, seconds=seconds))


async def open_loop_procs(
    url: str, data: bytes, *, rate: float, seconds: float, procs: int, started: asyncio.Event | None = None
) -> Phase:
    """:func:`open_loop` split over ``procs`` client processes; ``started`` is set when the arrivals begin."""
    started = started or asyncio.Event()
    if procs <= 1:
        started.set()
        return await open_loop(url, data, rate=rate, seconds=seconds)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        list(pool.map(time.sleep, [0.0] * procs))  # the processes are up before the clock starts
        start_at = time.time() + 0.5
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(pool, _child, url, data, rate / procs, seconds, start_at) for _ in range(procs)]
        await asyncio.sleep(max(0.0, start_at - time.time()))
        started.set()
        parts = await asyncio.gather(*futures)
    total = Phase(seconds)
    for part in parts:
        total.add(part)
    return total


async def _recovery(url: str, data: bytes, start: float, limit_s: float = 30.0) -> float | None:
    """Seconds from ``start`` until a request is answered 2xx (tried every 50 ms)."""
    async with RawClient(url, timeout_s=60.0) as client:
        while time.perf_counter() - start < limit_s:
            with contextlib.suppress(TransportError):
                if (await client.request(data)).status_code < 300:
                    return time.perf_counter() - start
            await asyncio.sleep(0.05)
    return None


async def overload_run(
    url: str,
    path: str,
    files: list[FilePart],
    *,
    pid: int | None,
    concurrency: int,
    capacity_s: float,
    overload_s: float,
    factor: float,
    procs: int = 1,
    stop: tuple[float, Callable[[], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Capacity, then ``factor`` × capacity over ``procs`` processes with the RSS of ``pid`` sampled, as JSON.
    ``stop``: ``(seconds, fn)``: ``fn`` stops the server that far into the overload (no recovery measured)."""
    data = encode(url, path, files)
    await closed_loop(url, data, concurrency=concurrency, seconds=min(3.0, capacity_s))  # warm-up
    idle_rss = rss_bytes(process_tree(pid)) if pid else 0  # after the warm-up: the server's working set at rest
    alone = await closed_loop(url, data, concurrency=1, seconds=3.0)
    cap = await closed_loop(url, data, concurrency=concurrency, seconds=capacity_s)
    capacity = len(cap.ok) / max(cap.elapsed_s, cap.seconds)
    peak = [0]

    tree = process_tree(pid) if pid else []  # once: walking all of /proc would stall this (the client's) loop

    async def sample() -> None:
        while tree:
            peak[0] = max(peak[0], rss_bytes(tree))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    started = asyncio.Event()
    rate = factor * capacity
    load = asyncio.create_task(open_loop_procs(url, data, rate=rate, seconds=overload_s, procs=procs, started=started))
    await started.wait()
    stopped: dict[str, Any] = {}
    if stop is not None:
        timer = threading.Timer(stop[0], lambda: stopped.update(stop[1]()))
        timer.start()
    await asyncio.sleep(overload_s)
    recovery = asyncio.create_task(_recovery(url, data, time.perf_counter())) if stop is None else None
    over = await load
    recovery_s = await recovery if recovery is not None else None
    if stop is not None:
        await asyncio.to_thread(timer.join)
    sampler.cancel()
    # the box may be shared: capacity once more after the overload shows how much it drifted meanwhile
    after = None if stop else await closed_loop(url, data, concurrency=concurrency, seconds=capacity_s)
    capacity_after = len(after.ok) / max(after.elapsed_s, after.seconds) if after else None
    o = over.to_dict()
    return {
        "capacity": cap.to_dict(),
        "overload": o,
        "factor": factor,
        "client_procs": procs,
        "capacity_per_s": round(capacity, 2),
        "offered_per_s": round(factor * capacity, 2),
        "goodput_ratio": round(o["ok_per_s"] / capacity, 3) if capacity else None,
        "capacity_after_per_s": round(capacity_after, 2) if capacity_after else None,
        # against the mean of the capacity before and after: what a drifting box gave meanwhile
        "goodput_ratio_bracketed": round(2 * o["ok_per_s"] / (capacity + capacity_after), 3) if after else None,
        "idle_rss_mib": round(idle_rss / 2**20, 1) if idle_rss else None,
        "peak_rss_mib": round(peak[0] / 2**20, 1) if peak[0] else None,
        "rss_growth": round(peak[0] / idle_rss - 1, 3) if idle_rss and peak[0] else None,
        "recovery_s": recovery_s,
        "unloaded_p50_s": _pct(alone.ok, 0.5),
        **({"stop": stopped} if stop is not None else {}),
    }


def process_tree(pid: int) -> list[int]:
    """Process ``pid`` and all its descendants (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(p := todo.pop())
        todo += children.get(p, [])
    return tree


def rss_bytes(pids: list[int]) -> int:
    """Resident set size of the processes ``pids``, summed (Linux; those gone count 0)."""
    total = 0
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/status") as f:
            total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    return total
