"""SIGTERM under load: admitted requests finish, the rest get a JSON 503, the process exits 0 in time."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

DRAIN_S = 1.0
CLIENTS = 32
#: photos per request: each request is real work for the server, so the clients cannot be the bottleneck
PHOTOS = 8


async def _load(url: str, photo: bytes, stop_at: list[float]) -> tuple[Counter[str], list[str], float]:
    """``CLIENTS`` clients posting ``PHOTOS`` photos each to /api/embed until their connection is refused (the server
    stopped accepting) or ``stop_at[0]``; returns the outcomes, the non-JSON answers, and the time of SIGTERM."""
    outcomes: Counter[str] = Counter()
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
    return outcomes, bad, 0.0


@pytest.mark.slow
@pytest.mark.lfw
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_under_load_answers_json_and_exits_zero_in_time(
    fg: SimpleNamespace, lfw_root: Path, tmp_path: Path, workers: int
) -> None:
    photo = fg.lfw_image(lfw_root, "Colin_Powell").read_bytes()
    server = fg.ServeProcess(tmp_path, workers=workers, env={"FACEGATE_SERVER__DRAIN_TIMEOUT_S": str(DRAIN_S)})
    try:
        server.wait_ready()
        stop_at = [time.monotonic() + 60.0]
        signalled: list[float] = []

        async def scenario() -> tuple[Counter[str], list[str], float]:
            load = asyncio.create_task(_load(server.url, photo, stop_at))
            await asyncio.sleep(3.0)  # the queue fills: far more requests in flight than the drain can finish
            server.proc.send_signal(signal.SIGTERM)
            signalled.append(time.monotonic())
            while server.proc.poll() is None and time.monotonic() < signalled[0] + DRAIN_S + 10:
                await asyncio.sleep(0.05)
            exited = time.monotonic()
            stop_at[0] = 0.0  # the clients stop at their next turn
            outcomes, bad, _ = await load
            return outcomes, bad, exited

        outcomes, bad, exited = asyncio.run(scenario())
        log = server.log()
    finally:
        rc = server.close()
    assert rc == 0, log[-3000:]
    assert exited - signalled[0] <= DRAIN_S + 2.0, (exited - signalled[0], log[-2000:])
    assert bad == [], bad[:5]  # never a plain-text answer
    assert outcomes["200:ok"] > 0, outcomes
    assert outcomes["503:shutting_down"] > 0, outcomes  # cut short at the drain timeout, or refused meanwhile
    assert set(k for k in outcomes if not k.startswith("transport:")) <= {"200:ok", "503:shutting_down"}, outcomes
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
