"""benchmarks/rawhttp.py against scripted asyncio servers: framing, keep-alive, retries and errors."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from rawhttp import (
    ConnectError,
    RawClient,
    ReadTimeout,
    RemoteProtocolError,
    encode_multipart,
    encode_request,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(n)


def _serve(handler: Handler, scenario: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await scenario(f"http://127.0.0.1:{port}")
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


class _OneAnswerPerConnection:
    """A handler that reads one request per connection, writes ``answers[i]`` on the i-th connection (the last
    one again after that), then closes; counts the connections."""

    def __init__(self, *answers: bytes) -> None:
        self.answers = answers
        self.conns = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conns += 1
        await _read_request(reader)
        writer.write(self.answers[min(self.conns, len(self.answers)) - 1])
        await writer.drain()
        writer.close()


def test_encode_request_and_multipart() -> None:
    body, ctype = encode_multipart({"aligned": "true"}, [("images", ("a.jpg", b"\xff\xd8xyz", "image/jpeg"))], "BND")
    assert ctype == "multipart/form-data; boundary=BND"
    assert body == (
        b'--BND\r\nContent-Disposition: form-data; name="aligned"\r\n\r\ntrue\r\n'
        b'--BND\r\nContent-Disposition: form-data; name="images"; filename="a.jpg"\r\n'
        b"Content-Type: image/jpeg\r\n\r\n\xff\xd8xyz\r\n--BND--\r\n"
    )
    req = encode_request("POST", "h:1", "/api/x", params={"crops": "true"}, body=b"abc", content_type="text/plain")
    assert req.startswith(b"POST /api/x?crops=true HTTP/1.1\r\nHost: h:1\r\n")
    assert b"\r\nContent-Length: 3\r\n" in req and req.endswith(b"\r\n\r\nabc")
    assert b"Content-Length" not in encode_request("GET", "h:1", "/readyz")


def test_keep_alive_content_length_chunked_and_informational() -> None:
    conns = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        while True:
            try:
                head, body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            if b"/chunked" in head:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                writer.write(b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    async def scenario(url: str) -> None:
        async with RawClient(url, timeout_s=5) as client:
            for i in range(3):
                r = await client.request(encode_request("POST", client.host_header, "/echo", body=b"x" * i))
                assert (r.status_code, r.content) == (201, b"x" * i)
            r = await client.request(encode_request("GET", client.host_header, "/chunked"))
            assert (r.status_code, r.content) == (200, b"hello world")
            r = await client.get("/echo")
            assert r.status_code == 201 and r.content == b""

    _serve(handler, scenario)
    assert conns == 1  # every request reused the first connection


def test_connection_close_and_body_to_eof_open_a_new_connection() -> None:
    handler = _OneAnswerPerConnection(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
        b'HTTP/1.1 200 OK\r\n\r\n{"a": 1}',  # no length: the body ends with the connection
    )

    async def scenario(url: str) -> None:
        async with RawClient(url, timeout_s=5) as client:
            assert (await client.get("/")).json() == {}
            assert (await client.get("/")).json() == {"a": 1}

    _serve(handler, scenario)
    assert handler.conns == 2


def test_a_kept_alive_connection_the_server_closed_is_retried_once() -> None:
    # closes after each answer without saying Connection: close (a keep-alive timeout)
    handler = _OneAnswerPerConnection(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def scenario(url: str) -> None:
        async with RawClient(url, timeout_s=5) as client:
            assert (await client.get("/")).content == b"ok"
            await asyncio.sleep(0.05)
            assert (await client.get("/")).content == b"ok"  # stale connection: retried on a new one

    _serve(handler, scenario)
    assert handler.conns == 2


def test_connect_and_timeout_errors_have_httpx_names() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def refused() -> None:
        async with RawClient(f"http://127.0.0.1:{port}", timeout_s=5) as client:
            await client.get("/")

    with pytest.raises(ConnectError):
        asyncio.run(refused())

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(1.0)
        writer.close()

    async def times_out(url: str) -> None:
        async with RawClient(url, timeout_s=0.2) as client:
            with pytest.raises(ReadTimeout):
                await client.get("/")

    _serve(slow, times_out)


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"SPDY/9 nonsense\r\n\r\n", "not an HTTP"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "IncompleteRead"),
    ],
    ids=["not_http", "short_body"],
)
def test_bad_answers_are_remote_protocol_errors(answer: bytes, match: str) -> None:
    handler = _OneAnswerPerConnection(answer)

    async def scenario(url: str) -> None:
        async with RawClient(url, timeout_s=5) as client:
            with pytest.raises(RemoteProtocolError, match=match):
                await client.get("/")

    _serve(handler, scenario)


def test_only_plain_http_urls() -> None:
    for bad in ("https://h:1", "http://h:1/prefix", "h:1"):
        with pytest.raises(ValueError, match="http://host:port"):
            RawClient(bad)
