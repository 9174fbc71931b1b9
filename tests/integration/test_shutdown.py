"""SIGTERM under load: admitted requests finish, the rest get a JSON 503, the process exits 0 in time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

DRAIN_S = 1.0
CLIENTS = 32
#: photos per request: each request is real work for the server, so the clients cannot be the bottleneck, and the
#: admitted requests outlast the drain on a fast CPU plan too (bf16 on AMX)
PHOTOS = 16


async def _load(url: str, photo: bytes, stop_at: list[float], outcomes: Counter[str]) -> list[str]:
    """``CLIENTS`` clients posting ``PHOTOS`` photos each to /api/embed until ``stop_at[0]``; returns the
    answers that were not JSON; ``outcomes`` counts the others (status and error code, or the transport error
    once the server stopped accepting)."""
    bad: list[str] = []
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)

    async def client(c: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at[0]:
            try:
                r = await c.post(
                    "/api/embed", files=[("images", (f"{i}.jpg", photo, "image/jpeg")) for i in range(PHOTOS)]
                )
            except httpx.TransportError as exc:  # refused or reset once the server stopped accepting
                outcomes[f"transport:{type(exc).__name__}"] += 1
                await asyncio.sleep(0.05)
                continue
            try:
                body = r.json()
                ok = r.headers["content-type"].startswith("application/json")
            except (json.JSONDecodeError, KeyError):
                ok = False
            if not ok:
                bad.append(f"{r.status_code} {r.headers.get('content-type')} {r.text[:80]!r}")
                continue
            code = body["error"]["code"] if r.status_code >= 400 else "ok"
            outcomes[f"{r.status_code}:{code}"] += 1

    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as c:
        tasks = [asyncio.create_task(client(c)) for _ in range(CLIENTS)]
        await asyncio.gather(*tasks)
    return bad


def _sigterm_under_load(
    fg: SimpleNamespace, lfw_root: Path, tmp_path: Path, workers: int
) -> tuple[int, float, Counter[str], list[str], str]:
    """Serve, load, SIGTERM; returns the exit status, the seconds from SIGTERM to exit, the outcomes, the
    non-JSON answers and the server's log."""
    photo = fg.lfw_image(lfw_root, "Colin_Powell").read_bytes()
    env = {"FACEGATE_DRAIN_S": str(DRAIN_S)}
    server = fg.ServeProcess(tmp_path, workers=workers, env=env)
    try:
        server.wait_ready()
        stop_at = [time.monotonic() + 120.0]
        outcomes: Counter[str] = Counter()

        async def scenario() -> tuple[list[str], float]:
            load = asyncio.create_task(_load(server.url, photo, stop_at, outcomes))
            t0 = time.monotonic()  # served for a while, and far more requests in flight than the drain can finish
            while outcomes["200:ok"] < CLIENTS // 4 and time.monotonic() < t0 + 60:
                await asyncio.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while server.proc.poll() is None and time.monotonic() < signalled + DRAIN_S + 30:
                await asyncio.sleep(0.05)
            elapsed = time.monotonic() - signalled
            stop_at[0] = 0.0  # the clients stop at their next turn
            return await load, elapsed

        bad, elapsed = asyncio.run(scenario())
        log = server.log()
    finally:
        rc = server.close()
    return rc, elapsed, outcomes, bad, log


@pytest.mark.slow
@pytest.mark.lfw
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_under_load_answers_json_and_exits_zero(
    fg: SimpleNamespace, lfw_root: Path, tmp_path: Path, workers: int
) -> None:
    rc, elapsed, outcomes, bad, log = _sigterm_under_load(fg, lfw_root, tmp_path, workers)
    assert rc == 0, log[-3000:]
    assert bad == [], bad[:5]  # never a plain-text answer
    assert outcomes["200:ok"] > 0, outcomes
    assert outcomes["503:shutting_down"] > 0, outcomes  # cut short at the drain timeout, or refused meanwhile
    answered = {k for k in outcomes if not k.startswith("transport:")}
    assert answered <= {"200:ok", "503:shutting_down", "503:overloaded"}, outcomes  # overloaded: admission control
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
    # a hang detector only (the box may be shared): the bound of the acceptance is the perf test below
    assert elapsed <= DRAIN_S + 20.0, elapsed


@pytest.mark.perf
@pytest.mark.slow
@pytest.mark.lfw
@pytest.mark.skipif(os.environ.get("FACEGATE_PERF") != "1", reason="wall-clock bound: set FACEGATE_PERF=1")
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_exits_within_the_drain_timeout_plus_2_s(
    fg: SimpleNamespace, lfw_root: Path, tmp_path: Path, workers: int
) -> None:
    rc, elapsed, _, bad, log = _sigterm_under_load(fg, lfw_root, tmp_path, workers)
    assert rc == 0 and bad == [], (rc, bad[:5])
    assert elapsed <= DRAIN_S + 2.0, (elapsed, log[-2000:])
