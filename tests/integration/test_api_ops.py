"""Operations over HTTP: health, readiness, metrics, OpenAPI, the page, and client disconnects."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

#: (method, path) of every route in docs/dev/http-api.md.
CONTRACT_ROUTES = {
    ("post", "/api/compare"),
    ("post", "/api/embed"),
    ("post", "/api/detect"),
    ("post", "/api/galleries"),
    ("get", "/api/galleries"),
    ("delete", "/api/galleries/{name}"),
    ("post", "/api/galleries/{name}/subjects/{subject_id}"),
    ("get", "/api/galleries/{name}/subjects"),
    ("delete", "/api/galleries/{name}/subjects/{subject_id}"),
    ("post", "/api/galleries/{name}/search"),
    ("post", "/api/galleries/{name}/templates"),
    ("post", "/api/galleries/{name}/enrolments"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
}


def test_health_ready_docs_page(client: httpx.Client, fg: SimpleNamespace) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {
        "status": "ready",
        "model": "sface-tiny",
        "device": "cpu",
        "precision": "fp32",
    }
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    spec = client.get("/openapi.json").json()
    routes = {(m, p) for p, ops in spec["paths"].items() for m in ops}
    assert routes == CONTRACT_ROUTES
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "facegate" in page.text.lower()
    # every asset the page links to is served
    for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text):
        r = client.get(asset)
        assert r.status_code == 200 and r.content, asset
    fg.assert_error(client.get("/static/nope.js"), 404, "not_found")


def test_metrics_record_requests_batches_and_quality(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    def scrape() -> str:
        r = client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return r.text

    before = scrape()
    labels = {"route": "POST /api/compare", "status": "200"}
    n0 = fg.parse_metric(before, "facegate_requests_total", labels) if "POST /api/compare" in before else 0.0
    img = fg.lfw_image(lfw_root, "Colin_Powell", 1)
    for _ in range(3):
        assert client.post("/api/compare", files=fg.files(img1=img, img2=img)).status_code == 200
    client.post("/api/compare", files=fg.files(img1=b"", img2=img))
    after = scrape()
    assert fg.parse_metric(after, "facegate_requests_total", labels) == n0 + 3
    assert fg.parse_metric(after, "facegate_requests_total", {"route": "POST /api/compare", "status": "400"}) >= 1
    lat = {"route": "POST /api/compare"}
    assert fg.parse_metric(after, "facegate_request_latency_seconds_count", lat) >= n0 + 4
    assert fg.parse_metric(after, "facegate_request_latency_seconds_sum", lat) > 0
    assert fg.parse_metric(after, "facegate_batch_size_count", {"stage": "detect"}) >= 1
    assert fg.parse_metric(after, "facegate_batch_size_count", {"stage": "embed"}) >= 1
    assert fg.parse_metric(after, "facegate_quality_score_count") >= 6
    # the service's view of each engine round trip: 6 photos detected and 6 faces embedded (at least)
    for stage in ("detect", "embed"):
        assert fg.parse_metric(after, "facegate_engine_call_seconds_count", {"stage": stage}) >= 6
        assert fg.parse_metric(after, "facegate_engine_call_seconds_sum", {"stage": stage}) > 0
    # unknown paths share one label (no unbounded label cardinality)
    client.get("/no/such/path/123")
    assert fg.parse_metric(scrape(), "facegate_requests_total", {"route": "GET unmatched", "status": "404"}) >= 1


def test_readyz_503_until_models_are_warm(server_factory, tmp_path: Path, lfw_root: Path, fg: SimpleNamespace) -> None:
    """The lifespan loads in the background: /healthz answers at once, /readyz and the API 503 until ready."""
    settings = fg.make_settings(tmp_path / "gated")
    service = fg.tiny_service(settings)
    release = threading.Event()
    real_start = service.start

    async def gated_start() -> None:  # the real start (warm-up + engine), held back until released
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 60)
        await real_start()

    service.start = gated_start
    srv = server_factory(settings, service=service, ready=False)
    with srv.client() as c:
        assert c.get("/healthz").status_code == 200
        fg.assert_error(c.get("/readyz"), 503, "engine_closed")
        r = c.post("/api/detect", files=fg.files(image=fg.lfw_image(lfw_root, "Colin_Powell", 1)))
        fg.assert_error(r, 503, "engine_closed")
        fg.assert_error(c.get("/api/galleries"), 503, "engine_closed")
        release.set()
        srv.wait_ready(30)
        assert c.get("/readyz").status_code == 200
        r = c.post("/api/detect", files=fg.files(image=fg.lfw_image(lfw_root, "Colin_Powell", 1)))
        assert r.status_code == 200


def _raw_multipart(field: str, data: bytes) -> tuple[bytes, bytes]:
    boundary = b"facegateboundary"
    body = (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="' + field.encode() + b'"; '
        b'filename="x.jpg"\r\nContent-Type: image/jpeg\r\n\r\n' + data + b"\r\n--" + boundary + b"--\r\n"
    )
    return body, b"multipart/form-data; boundary=" + boundary


def test_client_disconnect_cancels_queued_work(server_factory, lfw_root: Path, fg: SimpleNamespace) -> None:
    """A client that hangs up while its request waits in the engine: the request is cancelled and the
    engine drops the item before computing it (facegate_dropped_total{reason="cancelled"})."""
    srv = server_factory(max_wait_ms=1000.0, max_batch_size=64)  # a lone item waits 1 s for company
    body, ctype = _raw_multipart("image", fg.lfw_image(lfw_root, "Colin_Powell", 1).read_bytes())
    with srv.client() as c:
        m0 = c.get("/metrics").text
        dropped0 = fg.parse_metric(m0, "facegate_dropped_total", {"stage": "detect", "reason": "cancelled"})
        items0 = fg.parse_metric(m0, "facegate_items_total", {"stage": "detect"})

        with socket.create_connection((srv.settings.host, srv.settings.port)) as s:
            head = (
                b"POST /api/detect HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: " + ctype
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
            )  # fmt: skip
            s.sendall(head + body)
            time.sleep(0.3)  # the request is now parked in the detect queue
        # the socket is closed: the server sees the disconnect and cancels the request
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = c.get("/metrics").text
            if fg.parse_metric(m, "facegate_dropped_total", {"stage": "detect", "reason": "cancelled"}) > dropped0:
                break
            time.sleep(0.1)
        assert fg.parse_metric(m, "facegate_dropped_total", {"stage": "detect", "reason": "cancelled"}) == dropped0 + 1
        time.sleep(1.2)  # past the batch window: the cancelled item was never computed
        m = c.get("/metrics").text
        assert fg.parse_metric(m, "facegate_items_total", {"stage": "detect"}) == items0
        assert fg.parse_metric(m, "facegate_requests_total", {"route": "POST /api/detect", "status": "499"}) == 1
        # and the server is fine
        r = c.post("/api/detect", files=fg.files(image=fg.lfw_image(lfw_root, "Colin_Powell", 1)))
        assert r.status_code == 200 and len(r.json()["faces"]) >= 1


def test_a_client_gone_mid_upload_is_counted_499(server_factory, fg: SimpleNamespace) -> None:
    """A body that never arrives (the client hung up): nothing is answered, and the metrics say 499, not 500."""
    srv = server_factory()
    host, port = srv.settings.host, srv.settings.port
    for path, ctype in [("/api/galleries", "application/json"), ("/api/embed", "multipart/form-data; boundary=b")]:
        with socket.create_connection((host, port)) as s:  # the JSON read, the aligned-crop fast path's read
            head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\nContent-Length: 1000\r\n\r\n"
            s.sendall(head.encode() + b"--")
            time.sleep(0.3)
    with srv.client() as c:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            counted = [x for x in c.get("/metrics").text.splitlines() if x.startswith("facegate_requests_total{")]
            if sum(float(x.rsplit(" ", 1)[1]) for x in counted if 'status="499"' in x) >= 2:
                break
            time.sleep(0.1)
    assert any('route="POST unmatched",status="499"} 2' in x for x in counted), counted
    assert not any('status="500"' in x for x in counted), counted


def test_uvicorn_takes_the_c_http_parser_and_event_loop() -> None:
    """The one uvicorn configuration takes httptools (facegate's shedding subclass of uvicorn's protocol) and leaves
    the loop 'auto', which picks uvloop (dependencies)."""
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from facegate.api.app import create_app, uvicorn_config
    from facegate.config import Settings

    app = create_app(Settings(device="cpu"))
    auto = uvicorn_config(app, Settings(device="cpu"))
    assert auto.loop == "auto" and issubclass(auto.http, HttpToolsProtocol)
    assert (auto.host, auto.port, auto.lifespan, auto.access_log) == ("127.0.0.1", 7860, "on", False)
    auto.load()  # resolves 'auto' to the implementations it found
    assert issubclass(auto.http_protocol_class, HttpToolsProtocol), auto.http_protocol_class
    assert uvicorn.__version__
