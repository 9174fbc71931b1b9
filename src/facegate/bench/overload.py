"""Overload measurement: capacity in a closed loop, then an open loop at a multiple of it.

Used by the ``perf`` test (``tests/integration/test_overload.py``, seconds) and ``benchmarks/overload.py``
(60 s). Both phases run in the same run against the same server, so goodput is a ratio of two numbers
measured minutes apart on the same machine, not an absolute figure.

- **capacity**: ``concurrency`` clients each send the next request when the last one answers, for
  ``seconds``; capacity = 2xx answers per second.
- **overload**: requests arrive at ``rate`` per second regardless of answers (open loop, as from many
  independent clients); goodput = 2xx per second; admitted latency = that of the 2xx answers; shed latency
  = that of the 503s.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


@dataclass
class Phase:
    """Counts and latencies (seconds) of one phase."""

    seconds: float
    sent: int = 0
    ok: list[float] = field(default_factory=list)
    shed: list[float] = field(default_factory=list)
    other: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 2),
            "sent": self.sent,
            "ok": len(self.ok),
            "shed_503": len(self.shed),
            "other": self.other,
            "ok_per_s": round(len(self.ok) / self.seconds, 2),
            "ok_p50_s": _pct(self.ok, 0.50),
            "ok_p99_s": _pct(self.ok, 0.99),
            "ok_max_s": max(self.ok) if self.ok else None,
            "shed_p50_s": _pct(self.shed, 0.50),
            "shed_p99_s": _pct(self.shed, 0.99),
        }


async def _one(client: httpx.AsyncClient, path: str, files: list[Any], phase: Phase) -> None:
    t0 = time.perf_counter()
    try:
        r = await client.post(path, files=files)
        status = str(r.status_code)
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    dt = time.perf_counter() - t0
    phase.sent += 1
    if status.startswith("2"):
        phase.ok.append(dt)
    elif status == "503":
        phase.shed.append(dt)
    else:
        phase.other[status] = phase.other.get(status, 0) + 1


async def closed_loop(url: str, path: str, files: list[Any], *, concurrency: int, seconds: float) -> Phase:
    """``concurrency`` back-to-back clients for ``seconds``."""
    phase = Phase(seconds)
    end = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:

        async def worker() -> None:
            while time.perf_counter() < end:
                shed = len(phase.shed)
                await _one(client, path, files, phase)
                if len(phase.shed) > shed:  # told to come back later: a polite client pauses
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return phase


async def open_loop(
    url: str, path: str, files: list[Any], *, rate: float, seconds: float, max_open: int = 4000
) -> Phase:
    """Requests arriving at ``rate`` per second for ``seconds`` (at most ``max_open`` outstanding)."""
    phase = Phase(seconds)
    limits = httpx.Limits(max_connections=max_open, max_keepalive_connections=max_open)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        tasks: set[asyncio.Task[None]] = set()
        t0 = time.perf_counter()
        n = 0
        while (now := time.perf_counter()) < t0 + seconds:
            due = int((now - t0) * rate) + 1
            while n < due and len(tasks) < max_open:
                task = asyncio.create_task(_one(client, path, files, phase))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
            await asyncio.sleep(0.002)
        if tasks:
            await asyncio.gather(*tasks)
    return phase


async def _recovery(url: str, path: str, files: list[Any], start: float, limit_s: float = 30.0) -> float | None:
    """Seconds from ``start`` until a request of ``path`` is answered 2xx (tried every 50 ms)."""
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        while time.perf_counter() - start < limit_s:
            try:
                if (await client.post(path, files=files)).status_code < 300:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    return None


async def overload_run(
    url: str,
    path: str,
    files: list[Any],
    *,
    pid: int | None,
    concurrency: int,
    capacity_s: float,
    overload_s: float,
    factor: float,
) -> dict[str, Any]:
    """Capacity (closed loop), then ``factor`` × capacity (open loop) with RSS sampled; the figures as JSON."""
    await closed_loop(url, path, files, concurrency=concurrency, seconds=min(3.0, capacity_s))  # warm-up
    idle_rss = rss_bytes(pid) if pid else None
    alone = await closed_loop(url, path, files, concurrency=1, seconds=3.0)  # one request at a time
    cap = await closed_loop(url, path, files, concurrency=concurrency, seconds=capacity_s)
    capacity = len(cap.ok) / cap.seconds
    peak = [0]

    async def sample() -> None:
        while pid:
            peak[0] = max(peak[0], rss_bytes(pid))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    load = asyncio.create_task(open_loop(url, path, files, rate=factor * capacity, seconds=overload_s))
    await asyncio.sleep(overload_s)
    recovery = asyncio.create_task(_recovery(url, path, files, time.perf_counter()))
    over = await load
    recovery_s = await recovery
    sampler.cancel()
    o = over.to_dict()
    return {
        "capacity": cap.to_dict(),
        "overload": o,
        "factor": factor,
        "capacity_per_s": round(capacity, 2),
        "offered_per_s": round(factor * capacity, 2),
        "goodput_ratio": round(o["ok_per_s"] / capacity, 3) if capacity else None,
        "idle_rss_mib": round(idle_rss / 2**20, 1) if idle_rss else None,
        "peak_rss_mib": round(peak[0] / 2**20, 1) if peak[0] else None,
        "rss_growth": round(peak[0] / idle_rss - 1, 3) if idle_rss and peak[0] else None,
        "recovery_s": recovery_s,
        "unloaded_p50_s": _pct(alone.ok, 0.5),
    }


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


__all__ = ["Phase", "closed_loop", "open_loop", "overload_run", "rss_bytes"]
