"""A lean HTTP/1.1 client for load generation: pre-encoded requests over keep-alive connections.

httpx costs about as much CPU per request as the server it measures. Requests are bytes built once; responses are
framed by ``Content-Length``, chunked encoding or EOF; errors carry httpx's class names. No TLS or redirects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

#: a file part: ``(field name, (file name, bytes, MIME type))``
FilePart = tuple[str, tuple[str, bytes, str]]


class TransportError(Exception):
    """The request got no complete HTTP response."""


class ConnectError(TransportError):
    """The TCP connection could not be opened."""


class ReadTimeout(TransportError):  # noqa: N818 (httpx's name, so error counts match)
    """No complete response within the client's timeout."""


class RemoteProtocolError(TransportError):
    """The connection closed early or the response was not HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class RawResponse:
    """Status code and body of one response."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        """The body parsed as JSON (``ValueError`` if it is not)."""
        return json.loads(self.content)


def encode_multipart(
    fields: Mapping[str, str] | None, files: Iterable[FilePart], boundary: str | None = None
) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body of text ``fields`` then ``files``; returns ``(body, content type)``."""
    b = boundary or uuid.uuid4().hex
    parts: list[bytes] = []
    for name, value in (fields or {}).items():
        parts.append(f'--{b}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, (filename, data, mime) in files:
        head = f'--{b}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
        parts += [f"{head}Content-Type: {mime}\r\n\r\n".encode(), data, b"\r\n"]
    parts.append(f"--{b}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={b}"


def encode_request(
    method: str,
    host: str,
    path: str,
    *,
    params: Mapping[str, str] | None = None,
    body: bytes = b"",
    content_type: str | None = None,
) -> bytes:
    """One HTTP/1.1 request (keep-alive) as bytes, ready to write."""
    target = f"{path}?{urlencode(params)}" if params else path
    head = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Accept: */*", "User-Agent: facegate-bench"]
    if content_type:
        head.append(f"Content-Type: {content_type}")
    if body or method not in ("GET", "HEAD"):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _StaleConnectionError(Exception):
    """A reused connection was closed by the server before any of the response arrived."""


#: one open connection
_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class RawClient:
    """Keep-alive connections to one ``http://host:port`` for concurrent requests on one event loop; ``timeout_s``
    covers one request's connect, send and response."""

    def __init__(self, base_url: str, *, timeout_s: float = 60.0) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"RawClient needs http://host:port, got {base_url!r}")
        self.host = u.hostname
        self.port = u.port or 80
        self.host_header = u.netloc
        self.timeout_s = float(timeout_s)
        self._idle: list[_Conn] = []

    async def request(self, data: bytes) -> RawResponse:
        """Send one encoded request; a :class:`TransportError` if no response came. A kept-alive connection the
        server closed meanwhile is retried once on a new one, as httpx does."""
        if self._idle:
            try:
                return await self._send(data, self._idle.pop())
            except _StaleConnectionError:
                pass
        return await self._send(data, None)

    async def _send(self, data: bytes, conn: _Conn | None) -> RawResponse:
        reused = conn is not None
        try:
            async with asyncio.timeout(self.timeout_s):
                if conn is None:
                    try:
                        conn = await asyncio.open_connection(self.host, self.port, limit=2**20)
                    except OSError as exc:
                        raise ConnectError(f"{type(exc).__name__}: {exc}") from exc
                conn[1].write(data)
                status, body, keep = await _read_response(conn[0])
        except BaseException as exc:  # a cancel mid-request included: the connection's state is unknown
            if conn is not None:
                conn[1].close()
            if isinstance(exc, TimeoutError):
                raise ReadTimeout(f"no complete response within {self.timeout_s:g} s") from exc
            if not isinstance(exc, OSError | asyncio.IncompleteReadError | asyncio.LimitOverrunError | ValueError):
                raise
            nothing_read = isinstance(exc, ConnectionResetError | BrokenPipeError) or (
                isinstance(exc, asyncio.IncompleteReadError) and not exc.partial
            )
            if reused and nothing_read:
                raise _StaleConnectionError from exc
            raise RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc
        if keep:
            self._idle.append(conn)
        else:
            conn[1].close()
        return RawResponse(status, body)

    async def get(self, path: str) -> RawResponse:
        """``GET path`` (for occasional calls such as a readiness probe)."""
        return await self.request(encode_request("GET", self.host_header, path))

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
        for _, writer in idle:
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """``(status, body, keep-alive)`` of the next response on ``reader`` (1xx responses skipped)."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x response: {head[:40]!r}")
        status = int(head[9:12])
        if not 100 <= status < 200:
            break
    lower = head.lower()
    keep = not (b"\r\nconnection: close" in lower or head.startswith(b"HTTP/1.0"))
    i = lower.find(b"\r\ncontent-length:")
    if i >= 0:
        n = int(lower[i + 17 : lower.index(b"\r\n", i + 2)])
        body = await reader.readexactly(n) if n else b""
    elif b"\r\ntransfer-encoding: chunked" in lower:
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                break
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(chunks)
    elif status in (204, 304):
        body = b""
    else:  # delimited by the connection closing
        body, keep = await reader.read(), False
    return status, body, keep
