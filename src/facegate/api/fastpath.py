"""A fast path for aligned-crop embeds (``POST /api/embed`` with ``aligned=true``), below FastAPI's routing.

Aligned crops are the least GPU work per request, so the front-ends' Python sets their rate, and FastAPI's
stack above the endpoint costs several times the endpoint's own work. After the access checks and within the
admission bound and deadline, :class:`~facegate.api.app.ServingMiddleware` calls
:func:`serve_embed_aligned`, which answers a form of 1..``max_images_per_request`` ``images`` with ``aligned``
true (and at most a ``select``) through the route's own function and JSON; any other request goes to FastAPI
with its body replayed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from starlette.datastructures import FormData, UploadFile
from starlette.types import Receive, Scope, Send

from facegate.api.forms import FAST_FORM_MAX_BYTES, header, parse_small_multipart, replay_body
from facegate.errors import FacegateError

if TYPE_CHECKING:
    from facegate.api.state import ServingState

PATH = "/api/embed"
#: what ``scope["route"]`` holds for the request metrics (the route's path template)
ROUTE = SimpleNamespace(path=PATH)
#: the strings pydantic reads as a true ``bool`` (FastAPI's form field ``aligned``)
TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
SELECT = frozenset({"largest", "all"})
#: the multipart limits FastAPI's form reading applies by default (files, fields, bytes per field)
FORM_LIMITS = {"max_files": 1000, "max_fields": 1000, "max_part_size": 1024 * 1024}


def wants_fast_path(scope: Scope) -> bool:
    """Whether a request may take the fast path: ``POST /api/embed`` with a small multipart body."""
    if scope["method"] != "POST" or scope["path"] != PATH:
        return False
    length = header(scope, b"content-length")
    return (
        header(scope, b"content-type").startswith(b"multipart/form-data")
        and length.isdigit()
        and int(length) <= FAST_FORM_MAX_BYTES
    )


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


async def serve_embed_aligned(state: ServingState, scope: Scope, receive: Receive, send: Send) -> Receive | None:
    """Answer an aligned-crop embed request (None), or return a receive that replays its body for FastAPI.
    A body that did not arrive (a disconnect, over the route's limit) is left to the caller (None)."""
    from facegate.api.errors import facegate_error_response
    from facegate.api.routes import embed_response

    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    ctype = header(scope, b"content-type").decode("latin-1")
    limit = state.settings.limits.max_images_per_request
    images = aligned_images(parse_small_multipart(body, ctype, **FORM_LIMITS), limit)
    if images is None:
        return replay_body(body, receive)
    scope["route"] = ROUTE
    budget = scope["app"].state.facegate_pixels  # limits.request_pixels, decode_pixels_in_flight, as in forms
    try:
        pixels = budget.measure(images)
        await budget.acquire(pixels)
        try:
            out = await embed_response(state, state.require_service(), images, None, "largest", True)
        finally:
            budget.release(pixels)
    except FacegateError as exc:
        await facegate_error_response(exc)(scope, receive, send)
        return None
    payload = out.model_dump_json(by_alias=True, exclude_unset=True).encode()
    headers = [(b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
    return None
