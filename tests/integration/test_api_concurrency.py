"""64 concurrent clients: the engine batches across requests, and results equal the sequential ones."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np

log = logging.getLogger(__name__)

N_CLIENTS = 64


def _images(lfw_root: Path, n: int) -> list[Path]:
    """``n`` distinct LFW photos (all 250×250), from people with several photos, in a fixed order."""
    out: list[Path] = []
    for person in sorted((lfw_root / "lfw-deepfunneled").iterdir()):
        photos = sorted(person.glob("*.jpg"))
        if len(photos) >= 4:
            out.extend(photos[:4])
        if len(out) >= n:
            return out[:n]
    raise AssertionError("not enough LFW photos")


def _batch_totals(text: str, fg: SimpleNamespace, stage: str) -> tuple[float, float]:
    lbl = {"stage": stage}
    return fg.parse_metric(text, "facegate_batch_size_sum", lbl), fg.parse_metric(
        text, "facegate_batch_size_count", lbl
    )


def _embedding_and_box(body: dict) -> tuple[np.ndarray, np.ndarray]:
    face = body["results"][0]["faces"][0]
    return np.asarray(face["embedding"], np.float64), np.asarray(face["detection"]["box"], np.float64)


def test_64_concurrent_clients(tiny_server, client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    photos = _images(lfw_root, N_CLIENTS)
    payloads = [p.read_bytes() for p in photos]

    sequential = []
    for data in payloads:
        r = client.post("/api/embed", files=fg.many("images", [data]))
        assert r.status_code == 200, r.text
        sequential.append(_embedding_and_box(r.json()))

    m0 = client.get("/metrics").text
    det0, emb0 = _batch_totals(m0, fg, "detect"), _batch_totals(m0, fg, "embed")

    async def run_clients() -> list[httpx.Response]:
        start = asyncio.Event()

        async def one(data: bytes) -> httpx.Response:
            async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120) as c:  # one client each
                await c.get("/healthz")  # connect first, so the posts start together
                await start.wait()
                for _ in range(60):  # admission keeps about half a second of work; the rest is told to retry
                    r = await c.post("/api/embed", files=fg.many("images", [data]))
                    if r.status_code != 503:
                        return r
                    assert r.json()["error"]["code"] == "overloaded", r.text
                    await asyncio.sleep(float(r.headers["retry-after"]) / 4)
                return r

        tasks = [asyncio.create_task(one(d)) for d in payloads]
        await asyncio.sleep(0.5)
        start.set()
        return await asyncio.gather(*tasks)

    responses = asyncio.run(run_clients())
    assert [r.status_code for r in responses] == [200] * N_CLIENTS

    m1 = client.get("/metrics").text
    for stage, (s0, c0) in (("detect", det0), ("embed", emb0)):
        s1, c1 = _batch_totals(m1, fg, stage)
        assert s1 - s0 == N_CLIENTS, (stage, s1 - s0)  # every request's item went through the stage once
        mean = (s1 - s0) / (c1 - c0)
        log.info("%d concurrent clients: %s mean batch size %.2f over %d batches", N_CLIENTS, stage, mean, c1 - c0)
        assert mean > 1.0, f"{stage}: mean batch size {mean:.2f} under {N_CLIENTS} concurrent clients"

    for r, (emb_seq, box_seq) in zip(responses, sequential, strict=True):
        emb, box = _embedding_and_box(r.json())
        assert float(emb @ emb_seq) > 0.99999  # same photo, same embedding whatever the batch it ran in
        np.testing.assert_allclose(box, box_seq, atol=0.05)
