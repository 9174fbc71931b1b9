"""Fast paths for small ``multipart/form-data`` bodies: Starlette's streaming parser and FastAPI's stack cost a
front-end more than the aligned-crop work itself (``benchmarks/results/http_e2e-h100-forms-*.json``).

A plain UTF-8 body (first delimiter at the start, CRLF, named parts, no ``_charset_``, within the limits) of at most
:data:`FAST_FORM_MAX_BYTES` is cut at its boundaries here; anything else, every error case included, goes to
Starlette over the same cached body. :func:`wants_fast_path` and :func:`aligned_images` pick the requests that
:func:`facegate.api.routes.serve_embed_aligned` answers itself.
"""

from __future__ import annotations

import io
import math
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

from fastapi.routing import APIRoute
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, Headers, UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope

from facegate.errors import BodyTooLargeError

#: Bodies up to this size are read whole into memory and cut here; larger ones stream through Starlette.
FAST_FORM_MAX_BYTES = 8 * 2**20
EMBED_PATH = "/api/embed"
#: what ``scope["route"]`` holds for the request metrics (the route's path template)
EMBED_ROUTE = SimpleNamespace(path=EMBED_PATH)
#: the strings pydantic reads as a true ``bool`` (FastAPI's form field ``aligned``)
TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
SELECT = frozenset({"largest", "all"})


class _MemoryFile(io.BytesIO):
    """An upload in memory; ``_rolled = False`` makes Starlette's UploadFile read it inline, not on a thread."""

    _rolled = False


def header(scope: Scope, name: bytes) -> bytes:
    """The value of request header ``name`` (lower-case bytes), or ``b""``."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return b""


def is_multipart(content_type: str | bytes) -> bool:
    """Whether a Content-Type is ``multipart/form-data`` as Starlette reads it (media types ignore case)."""
    return parse_options_header(content_type)[0] == b"multipart/form-data"


def is_small_multipart(scope: Scope) -> bool:
    """Whether a request's body is ``multipart/form-data`` of at most :data:`FAST_FORM_MAX_BYTES` (by its headers)."""
    length = header(scope, b"content-length")
    return is_multipart(header(scope, b"content-type")) and length.isdigit() and int(length) <= FAST_FORM_MAX_BYTES


def _decode(raw: bytes) -> str:
    """Starlette's decoding of names and field values: UTF-8, else latin-1."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


#: Starlette's form limits (``Request.form``'s defaults; facegate sets none): files, fields, bytes of a field
MAX_FILES = MAX_FIELDS = 1000
MAX_PART_SIZE = 1024 * 1024


def parse_small_multipart(body: bytes, content_type: str) -> FormData | None:
    """The form of a ``multipart/form-data`` body as Starlette builds it (files in memory), or ``None`` when
    Starlette's parser should answer instead."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    # Starlette decodes names and values in the Content-Type's charset: any other than UTF-8 goes to it
    if not boundary or len(boundary) > 200 or params.get(b"charset", b"utf-8").lower() not in (b"utf-8", b"utf8"):
        return None
    delim = b"--" + boundary
    if not body.startswith(delim):
        return None
    sep = b"\r\n" + delim
    pos = len(delim)
    items: list[tuple[str, str | UploadFile]] = []
    n_files = n_fields = 0
    while True:
        if body.startswith(b"--", pos):  # the closing delimiter; anything after it is the epilogue
            return FormData(items)
        if not body.startswith(b"\r\n", pos):
            return None
        head_end = body.find(b"\r\n\r\n", pos + 2)
        end = body.find(sep, head_end + 4)
        if head_end < 0 or end < 0:
            return None
        headers: list[tuple[bytes, bytes]] = []
        for line in body[pos + 2 : head_end].split(b"\r\n"):
            name, colon, value = line.partition(b":")
            if not colon or not name or name[:1] in (b" ", b"\t"):
                return None  # not a header line, or obsolete folding
            headers.append((name.strip().lower(), value.strip()))
        disposition = next((v for k, v in headers if k == b"content-disposition"), None)
        if disposition is None:
            return None
        _, options = parse_options_header(disposition)
        if b"name" not in options:
            return None
        field = _decode(options[b"name"])
        data = body[head_end + 4 : end]
        if b"filename" in options:
            n_files += 1
            if n_files > MAX_FILES:
                return None
            file = UploadFile(
                file=_MemoryFile(data),  # type: ignore[arg-type]
                size=len(data),
                filename=_decode(options[b"filename"]),
                headers=Headers(raw=headers),
            )
            items.append((field, file))
        else:
            n_fields += 1
            if n_fields > MAX_FIELDS or len(data) > MAX_PART_SIZE or field == "_charset_":
                return None
            items.append((field, _decode(data)))
        pos = end + len(sep)


async def read_form(request: Request) -> FormData:
    """The form of a multipart request, which FastAPI's own ``request.form()`` then gets: cut by
    :func:`parse_small_multipart` when small, else (or when it hands over) parsed by Starlette over the cached body."""
    if is_small_multipart(request.scope):
        request._form = parse_small_multipart(await request.body(), request.headers["content-type"])
    return await request.form()


class FastFormRoute(APIRoute):
    """An API route whose handler reads the form with :func:`read_form` and holds its pixel budget."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def fast_form_handler(request: Request) -> Response:
            if not is_multipart(request.headers.get("content-type", "")):
                return await handler(request)
            try:
                form = await read_form(request)
            except Exception:  # a malformed body: FastAPI parses it again and gives its own 4xx answer
                return await handler(request)
            uploads = (v for _, v in form.multi_items() if isinstance(v, UploadFile))
            async with request.app.state.facegate_pixels.hold(uploads):  # the app's api.limits.PixelBudget
                return await handler(request)

        return fast_form_handler


async def read_body(receive: Receive, cap: float = math.inf) -> bytes | None:
    """A whole request body, or ``None`` when the client went away; BodyTooLargeError past ``cap`` bytes
    (before the rest is read)."""
    buf, more = bytearray(), True  # not bytes ``+=``: quadratic on a many-megabyte import
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        buf += message.get("body", b"")
        if len(buf) > cap:
            raise BodyTooLargeError(f"a JSON body of more than {cap} bytes", detail={"field": "body", "limit": cap})
        more = bool(message.get("more_body", False))
    return bytes(buf)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A receive callable that gives ``body`` (read already, whole) once, then defers to ``receive``."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def wants_fast_path(scope: Scope) -> bool:
    return scope["method"] == "POST" and scope["path"] == EMBED_PATH and is_small_multipart(scope)


def aligned_images(form: FormData | None, max_images: int) -> list[UploadFile] | None:
    """The uploads of a parsed form that the fast path serves, or None (then FastAPI serves it)."""
    if form is None:
        return None
    images: list[UploadFile] = []
    aligned = False
    for key, value in form.multi_items():
        if key == "images" and isinstance(value, UploadFile):
            images.append(value)
        elif key == "aligned" and isinstance(value, str) and value.lower() in TRUE and not aligned:
            aligned = True
        elif not (key == "select" and value in SELECT):
            return None  # another field, a repeated or non-true ``aligned``, an invalid ``select``
    return images if aligned and 1 <= len(images) <= max_images else None
