"""Shedding in uvicorn's HTTP protocol (facegate.api.limits.ShedProtocol) against a real server on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import uvicorn

from facegate.api import limits
from facegate.api.app import create_app
from facegate.api.limits import ShedProtocol


def _hold_the_only_slot(host: str, port: int) -> socket.socket:
    """An upload whose body never comes: it holds the one admission slot until its deadline."""
    hold = socket.create_connection((host, port))
    hold.sendall(
        f"POST /api/detect HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        "Content-Length: 100000\r\n\r\n--b\r\n".encode()
    )
    time.sleep(0.3)
    return hold


def _read_response(f: object, *, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One response off ``f``; ``head``: the answer to a HEAD, whose Content-Length comes with no body."""
    status = int(f.readline().split()[1])  # type: ignore[attr-defined]
    headers = {}
    while (line := f.readline().decode()) != "\r\n":  # type: ignore[attr-defined]
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return status, headers, b"" if head else f.read(int(headers["content-length"]))  # type: ignore[attr-defined]


def test_refusals_are_json_keep_the_connection_and_are_counted(
    server_factory, fg: SimpleNamespace, monkeypatch
) -> None:
    # the pause after a refusal, lengthened so that a lower bound tells it apart from none on a loaded box
    monkeypatch.setattr(limits, "REFUSED_PAUSE_S", 1.0)
    srv = server_factory(limits={"max_admitted": 1}, request_timeout_s=8.0)
    host, port = srv.settings.host, srv.settings.port
    body = b"--b\r\n" + b"x" * 200_000 + b"\r\n--b--\r\n"
    request = (
        f"POST /api/detect HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with _hold_the_only_slot(host, port), socket.create_connection((host, port)) as conn:
        conn.settimeout(10)
        f = conn.makefile("rb")
        waited = []
        for _ in range(2):  # one connection: each refused body is read and dropped, the next request follows
            t0 = time.monotonic()
            conn.sendall(request)
            status, headers, answer = _read_response(f)
            waited.append(time.monotonic() - t0)
            assert status == 503 and json.loads(answer)["error"]["code"] == "overloaded"
            assert headers["retry-after"] == "1" and headers["content-type"].startswith("application/json")
            assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
            assert "content-security-policy" in headers and headers.get("connection") != "close"
            assert "server" not in headers  # answered in the protocol: uvicorn adds its headers to ASGI answers
        # the request sent at once after a refusal is read once the pause has passed (a lower bound only: a loaded
        # box answers later, never sooner)
        assert waited[1] > 0.3, waited
        # a HEAD is refused too, without a body: the next response on the connection must come next
        conn.sendall(f"HEAD /api/galleries HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        status, headers, _ = _read_response(f, head=True)
        assert status == 503 and headers["content-type"].startswith("application/json")
        conn.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        assert _read_response(f)[0] == 200
    with srv.client() as c:
        text = c.get("/metrics").text
    counted = [line for line in text.splitlines() if line.startswith("facegate_requests_total{")]
    shed = [line for line in counted if 'route="POST unmatched"' in line and 'status="503"' in line]
    assert shed and float(shed[0].rsplit(" ", 1)[1]) >= 2, counted
    assert any('route="HEAD unmatched"' in line and 'status="503"' in line for line in counted), counted


def test_a_stalled_json_body_meets_the_deadline_and_frees_its_slot(server_factory) -> None:
    """The deadline covers a JSON upload too: a body that never comes is answered 504, not held forever."""
    srv = server_factory(limits={"max_admitted": 1}, request_timeout_s=1.0)
    host, port = srv.settings.host, srv.settings.port
    with socket.create_connection((host, port)) as hold:
        hold.settimeout(15)
        hold.sendall(
            f"POST /api/galleries HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            'Content-Length: 1000\r\n\r\n{"na'.encode()
        )
        status, _, answer = _read_response(hold.makefile("rb"))
    assert status == 504 and json.loads(answer)["error"]["code"] == "deadline_exceeded"
    with srv.client() as c:
        assert c.get("/api/galleries").status_code == 200


def test_without_the_protocol_the_middleware_sheds_the_same_answer(tmp_path, fg: SimpleNamespace) -> None:
    """A plain uvicorn configuration (as in an embedding app) still sheds, with the same JSON body."""
    settings = fg.make_settings(tmp_path / "data", limits={"max_admitted": 1}, request_timeout_s=3.0)
    app = create_app(settings, fg.tiny_service(settings))
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://{settings.host}:{settings.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert config.http_protocol_class is not ShedProtocol
        with _hold_the_only_slot(settings.host, settings.port):
            r = httpx.post(url + "/api/detect", files=fg.files(image=b"x" * 50_000), timeout=10)
        err = fg.assert_error(r, 503, "overloaded")
        assert r.headers["retry-after"] == "1" and err["detail"]["limit"] == 1 and "server" in r.headers
    finally:
        server.should_exit = True
        thread.join(30)
