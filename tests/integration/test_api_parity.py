"""Throughput parity (in the spirit of LitServe's test): facegate's server vs a plain FastAPI endpoint.

Both servers run in this process on loopback at the same time, share the *same* real
:class:`~facegate.pipeline.pipeline.FacePipeline` (default models, CPU), and get the same requests
(``POST /api/compare`` with two LFW photos). The plain server is the obvious FastAPI app: a sync endpoint
(FastAPI runs it in its thread pool) that decodes both uploads and calls ``pipeline.faces`` and
``pipeline.compare_faces`` directly. facegate adds its engine (queue, batch window, cross-request
batching), the decode pool, the middleware and the response models.

At concurrency 1 (one client, one request at a time) batching cannot help, so this measures facegate's
overhead. Requests alternate between the two servers (ABAB...) so that load from elsewhere on the
machine hits both alike; the test asserts that facegate's throughput (1 / median latency) is at least
``1 - MARGIN`` of the plain server's and logs the measured ratio.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import httpx
import pytest
from fastapi import FastAPI, File, UploadFile

log = logging.getLogger(__name__)

#: facegate may be at most this much slower (throughput) than the plain endpoint at concurrency 1. Generous
#: because the 2-core dev machine is shared: with this method the ratio measured 0.82-0.94 across runs
#: at load average ~10 (facegate hands each request across more threads, which costs more when the
#: cores are oversubscribed).
MARGIN = 0.25
WARMUP = 3
REQUESTS = 24


def plain_app(pipeline: Any, max_bytes: int, max_pixels: int) -> FastAPI:
    """The baseline: FastAPI calling the same pipeline synchronously, nothing else."""
    from facegate.io.decode import decode_image

    app = FastAPI()

    @app.post("/api/compare")
    def compare(img1: Annotated[UploadFile, File()], img2: Annotated[UploadFile, File()]) -> dict[str, Any]:
        images = [decode_image(f.file.read(), max_bytes=max_bytes, max_pixels=max_pixels) for f in (img1, img2)]
        a, b = (faces[0] for faces in pipeline.faces(images))
        res = pipeline.compare_faces(a, b)
        return {
            "similarity": res.similarity,
            "match": res.match,
            "refused": res.refused,
            "reason": res.reason,
            "threshold": res.threshold,
            "faces": [a.to_dict(), b.to_dict()],
        }

    return app


def _serve_plain(app: FastAPI, port: int) -> tuple[Any, threading.Thread]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "plain server did not start"
        time.sleep(0.01)
    return server, thread


@pytest.mark.slow
def test_throughput_parity_at_concurrency_1(
    server_factory, tmp_path: Path, lfw_root: Path, fg: SimpleNamespace, record_property
) -> None:
    from facegate.service.faces import FaceService

    settings = fg.make_settings(tmp_path / "parity", max_upload_bytes=1 << 20)
    service = FaceService.build(settings)  # the real default models
    facegate = server_factory(settings, service=service)
    plain_server, plain_thread = _serve_plain(
        plain_app(service.pipeline, settings.limits.max_upload_bytes, settings.limits.max_pixels), fg.free_port()
    )
    plain_url = f"http://127.0.0.1:{plain_server.config.port}"
    pairs = [
        (fg.lfw_image(lfw_root, a, 1).read_bytes(), fg.lfw_image(lfw_root, b, 2).read_bytes())
        for a, b in (
            ("Colin_Powell", "Colin_Powell"),
            ("Tony_Blair", "George_W_Bush"),
            ("Donald_Rumsfeld", "Gerhard_Schroeder"),
        )
    ]

    def timed(c: httpx.Client, i: int) -> tuple[float, float | None]:
        a, b = pairs[i % len(pairs)]
        t0 = time.perf_counter()
        r = c.post("/api/compare", files=fg.files(img1=a, img2=b))
        dt = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        return dt, r.json()["similarity"]

    t_fg: list[float] = []
    t_plain: list[float] = []
    try:
        with facegate.client() as fc, httpx.Client(base_url=plain_url, timeout=120) as pc:
            for i in range(WARMUP):  # connections, allocator, caches
                timed(fc, i), timed(pc, i)
            for i in range(REQUESTS):  # alternate request by request: both see the same ambient load
                dt_fg, sim_fg = timed(fc, i)
                dt_plain, sim_plain = timed(pc, i)
                t_fg.append(dt_fg)
                t_plain.append(dt_plain)
                assert sim_fg == pytest.approx(sim_plain, abs=1e-5)  # same pipeline, same request, same answer
    finally:
        plain_server.should_exit = True
        plain_thread.join(30)

    # throughput at concurrency 1 is 1 / latency; medians, because the machine is shared and a few
    # requests of either server get descheduled
    rps_fg, rps_plain = 1.0 / statistics.median(t_fg), 1.0 / statistics.median(t_plain)
    ratio = rps_fg / rps_plain
    mean_ratio = sum(t_plain) / sum(t_fg)
    record_property("throughput_ratio_facegate_over_plain", round(ratio, 3))
    log.info(
        "concurrency 1, %d compare requests each (real models, CPU): facegate %.2f req/s, plain FastAPI %.2f req/s "
        "(medians), ratio %.3f (from means: %.3f)",
        REQUESTS, rps_fg, rps_plain, ratio, mean_ratio,
    )  # fmt: skip
    assert ratio >= 1.0 - MARGIN, f"facegate {rps_fg:.2f} req/s vs plain {rps_plain:.2f} req/s (ratio {ratio:.3f})"
