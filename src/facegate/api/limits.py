"""Input limits of the HTTP front-end: bounded JSON (:func:`loads_limited`), decoded-pixel
budgets (:class:`PixelBudget`) and admission before any work (:class:`Admission`: 503 ``overloaded`` past the
bound, mostly refused by :class:`ShedProtocol` before any task exists).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import re
import time
import types
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from PIL import Image
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse
from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from facegate.api.drain import DRAIN
from facegate.api.errors import facegate_error_response
from facegate.api.forms import header
from facegate.api.security import CSP, FIXED_HEADERS
from facegate.config import Limits, Settings
from facegate.errors import BodyTooLargeError, ImageTooLargeError, InvalidParameterError, OverloadedError
from facegate.io.decode import FORMATS
from facegate.models.registry import get_spec

#: Seconds a shed client is told to wait (Retry-After); one is the smallest the header can say.
RETRY_AFTER_S = 1
#: Seconds a connection is not read after a refusal written on it by :class:`ShedProtocol` (its next request waits):
#: at most ten refusals a second each, so clients that send again at once cannot fill the event loop with them.
REFUSED_PAUSE_S = 0.1


def _bad_json(message: str, field: str) -> InvalidParameterError:
    return InvalidParameterError(message, detail={"field": field})


#: The template import takes up to this many templates (its schema's ``max_length``) in one JSON body.
IMPORT_MAX_ROWS = 10_000
TEMPLATES_ROUTE = re.compile(r"^/api/galleries/[^/]+/templates/?$")


def import_max_bytes(settings: Settings) -> int:
    """The template import's JSON body limit: :data:`IMPORT_MAX_ROWS` rows of the served model's dimension
    at 26 bytes a number (the longest float literal and its separator) and 200 for each id and quality."""
    return max(settings.limits.json_max_bytes, IMPORT_MAX_ROWS * (26 * get_spec(settings.model).embedding_dim + 200))


def loads_limited(text: str | bytes, limits: Limits, *, field: str = "body", max_bytes: int | None = None) -> Any:
    """``json.loads`` under ``limits``: BodyTooLargeError past ``max_bytes`` (default ``json_max_bytes``);
    InvalidParameterError for non-UTF-8, non-JSON, nesting past ``json_max_depth``, number literals past
    ``json_max_number_digits``, NaN/Infinity, or a lone surrogate (which no UTF-8 store can hold)."""
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
    cap = limits.json_max_bytes if max_bytes is None else max_bytes
    if size > cap:
        raise BodyTooLargeError(
            f"{field}: {size} bytes of JSON exceed the limit of {cap}",
            detail={"field": field, "bytes": size, "limit": cap},
        )
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad_json(f"{field} is not UTF-8", field) from None
    _check_depth(text, limits.json_max_depth, field)
    digits = limits.json_max_number_digits

    def number(literal: str) -> str:
        if len(literal) > digits:
            raise _bad_json(f"{field}: a number of {len(literal)} characters exceeds the limit of {digits}", field)
        return literal

    def constant(name: str) -> Any:
        raise _bad_json(f"{field}: {name} is not a JSON number", field)

    try:
        value = json.loads(
            text, parse_int=lambda s: int(number(s)), parse_float=lambda s: float(number(s)), parse_constant=constant
        )
    except json.JSONDecodeError as exc:
        raise _bad_json(f"{field} is not valid JSON: {exc.msg} at position {exc.pos}", field) from None
    except RecursionError:  # _check_depth bounds nesting first; this is only a second line
        raise _bad_json(f"{field}: JSON nested too deeply", field) from None
    try:  # a lone surrogate (a JSON \ud800 escape) cannot be encoded
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _bad_json(f"{field}: a string holds a lone UTF-16 surrogate", field) from None
    return value


def _check_depth(text: str, max_depth: int, field: str) -> None:
    """Refuse nesting deeper than ``max_depth`` by scanning brackets outside strings (before parsing)."""
    if text.count("[") + text.count("{") <= max_depth:
        return
    depth = 0
    # strings may hold brackets: drop them first (escapes included), then count what is left
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', "", text):
        if ch in "[{":
            depth += 1
            if depth > max_depth:
                raise _bad_json(f"{field}: JSON nested deeper than {max_depth} levels", field)
        elif ch in "]}":
            depth -= 1


def header_pixels(file: UploadFile) -> int:
    """``width × height`` of an uploaded image from its header (no pixel data is decoded); 0 when the
    header cannot be read (the decoder then answers the request's error)."""
    f = file.file
    try:
        f.seek(0)
        with Image.open(f, formats=FORMATS) as img:
            return img.width * img.height
    except Image.DecompressionBombError:
        return 2 * (Image.MAX_IMAGE_PIXELS or 0) + 1
    except Exception:  # not an image, truncated header, ...: the decoder reports it properly
        return 0
    finally:
        f.seek(0)


class PixelBudget:
    """The decoded pixels one process may hold (``limits.decode_pixels_in_flight``), shared by its requests."""

    def __init__(self, limits: Limits) -> None:
        self.per_request = limits.request_pixels
        self.per_image = limits.max_pixels
        self.total = limits.decode_pixels_in_flight
        self.held = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, uploads: Iterable[UploadFile]) -> AsyncIterator[None]:
        """Hold the uploads' pixels (from their headers, before anything is decoded) for the block;
        ImageTooLargeError as soon as their sum passes ``request_pixels``. An image past ``max_pixels`` counts
        nothing: the decoder refuses it from its header, as that image (the request's other images still run)."""
        pixels = 0
        for i, upload in enumerate(uploads):
            n = header_pixels(upload)
            pixels += n if n <= self.per_image else 0
            if pixels > self.per_request:
                raise ImageTooLargeError(
                    f"the request's images have more than {self.per_request} pixels in all (after image {i})",
                    detail={"unit": "pixels", "limit": self.per_request, "index": i},
                )
        await self.acquire(pixels)
        try:
            yield
        finally:
            self.release(pixels)

    async def acquire(self, pixels: int) -> None:
        """Hold ``pixels`` of the process budget, waiting (first come, first served) while others hold too
        many. Cancellable: a request whose deadline passes while it waits holds nothing."""
        pixels = min(pixels, self.total)
        if not self._waiters and self.held + pixels <= self.total:
            self.held += pixels
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (pixels, fut)
        self._waiters.append(entry)
        try:
            await fut  # _wake adds the pixels to held before it resolves the future
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(pixels)  # granted, but the waiter went away at the same moment
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, pixels: int) -> None:
        """Give back what :meth:`acquire` took (synchronous, so that it also runs in a cancelled task)."""
        self.held -= min(pixels, self.total)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.held + self._waiters[0][0] <= self.total:
            pixels, fut = self._waiters.popleft()
            if not fut.done():
                self.held += pixels
                fut.set_result(None)


def is_json(scope: Scope) -> bool:
    ctype = header(scope, b"content-type").split(b";", 1)[0].strip().lower()
    return ctype == b"application/json" or ctype.endswith(b"+json")


#: uvicorn's lifespan state (shared with its protocols) holds the process's :class:`Admission` under this key.
STATE_KEY = "facegate.admission"


class Admission:
    """How many requests a front-end admits at once (docs/security.md), its admitted-request count, and its 503
    ``overloaded`` answers, built once per bound value (a response and raw HTTP bytes) so that a flood of
    refusals costs next to nothing.

    The rate's :meth:`bound`: at most ``max_admitted``, and at most what it finishes in ``queue_s`` seconds, at
    least :data:`FLOOR`. The best rate seen bounds a burst, the window's rate bounds it while it sheds; only rates
    over at least half a window busy count.

    While it sheds, a cap also follows the event loop's lateness (:attr:`loop`): a turn later than
    :data:`LAG_HIGH_S` cuts it by :data:`CUT` (at most once per :data:`CUT_EVERY_S`), a loop late that long in a
    row in proportion, to turn within :data:`LAG_AIM_S`; each punctual turn raises it by one, never above the
    rate's bound, so that a cut always bites.
    """

    WINDOW_S = 4.0
    QUEUE_S = 0.5
    FLOOR = 4
    _SLOTS = 8
    TICK_S = 0.01
    LAG_HIGH_S = 0.01
    LAG_LOW_S = 0.002
    LAG_AIM_S = 0.05
    CUT = 0.9
    CUT_DEEPEST = 0.5
    CUT_EVERY_S = 0.1

    def __init__(self, settings: Settings, queue_s: float = QUEUE_S) -> None:
        self.max_admitted = self.cap = settings.limits.max_admitted
        self.target_s = min(queue_s, settings.limits.request_timeout_s / 4)
        self._width = self.WINDOW_S / self._SLOTS
        self._counts = [0] * self._SLOTS
        self._slot_ids = [-1] * self._SLOTS
        self._best = 0.0
        self._busy_sid = -1
        self.last_shed = -math.inf  # when a request was last refused
        self._cached: tuple[tuple[int, int, bool], int] | None = None
        self.admitted = 0
        self._answers: dict[int, tuple[JSONResponse, bytes]] = {}
        #: ``record(route, status, seconds)`` of the app's request metrics (never raises), for ShedProtocol's refusals
        self.record: Callable[[str, int, float], None] = lambda route, status, seconds: None
        #: the event loop whose lateness a refusal starts following, every :data:`TICK_S` while it refuses
        self.loop: asyncio.AbstractEventLoop | None = None
        self._armed = False
        self._due = 0.0
        self._last_cut = -math.inf
        self._late_since = math.inf  # when the loop's current run of late turns began

    def busy(self, now: float) -> None:
        """Note that the process went from no request in progress to one at ``now`` (``time.monotonic()``)."""
        self._busy_sid = int(now / self._width)

    def finished(self, now: float) -> None:
        """Count one admitted request that ended at ``now``."""
        sid = int(now / self._width)
        i = sid % self._SLOTS
        if self._slot_ids[i] != sid:
            self._slot_ids[i], self._counts[i] = sid, 0
        self._counts[i] += 1

    def bound(self, now: float) -> int:
        """The rate's bound now; cached per (slot, busy slot, shedding), since a flood's refusals each ask for it."""
        sid = int(now / self._width)
        shedding = now - self.last_shed < self.WINDOW_S
        key = (sid, self._busy_sid, shedding)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        first = max(sid - self._SLOTS + 1, self._busy_sid)  # the completed slots since the process got busy
        done = sum(c for c, s in zip(self._counts, self._slot_ids, strict=True) if first <= s < sid)
        rate = done / ((sid - first) * self._width) if sid > first else 0.0
        settled = sid - first >= self._SLOTS // 2
        if settled:
            self._best = max(self._best, rate)
        if self._best == 0.0:
            return self.max_admitted  # nothing measured yet
        if not settled or not shedding:
            rate = self._best  # not shedding, or busy too briefly for the window to tell
        bound = min(self.max_admitted, max(self.FLOOR, math.ceil(rate * self.target_s)))
        self._cached = (key, bound)
        return bound

    def _tick(self) -> None:
        assert self.loop is not None
        now = self.loop.time()
        mono = time.monotonic()
        self.lagged(now - self._due, mono)
        if mono - self.last_shed < self.WINDOW_S:
            self._due = now + self.TICK_S
            self.loop.call_at(self._due, self._tick)
        else:
            self._armed = False

    def lagged(self, lag_s: float, now: float) -> None:
        """Adjust the cap for a loop turn ``lag_s`` seconds late at ``now`` (``time.monotonic()``)."""
        if now - self.last_shed >= self.WINDOW_S:
            self.cap = self.max_admitted
            return
        limit = min(self.cap, self.bound(now))  # what is admitted now (as refuse sees it)
        if lag_s <= self.LAG_HIGH_S:
            self._late_since = math.inf
            if lag_s < self.LAG_LOW_S:
                self.cap = min(limit + 1, self.cap + 1)
            return
        self._late_since = min(self._late_since, now - lag_s)
        if now - self._last_cut >= self.CUT_EVERY_S:
            keep = self.CUT
            if now - self._late_since >= self.CUT_EVERY_S:  # late for a while, not a one-off stall
                keep = min(self.CUT, max(self.CUT_DEEPEST, self.LAG_AIM_S / lag_s))
            self.cap = max(self.FLOOR, math.floor(limit * keep))
            self._last_cut = now

    def refuse(self, now: float) -> tuple[JSONResponse, bytes] | None:
        """``None`` when a new request may be admitted at ``now``; else the refusal, as a response (for ASGI) and
        as the whole response's bytes (for :class:`ShedProtocol`)."""
        limit = min(self.bound(now), self.cap)
        if self.admitted < limit:
            return None
        self.last_shed = now
        if self.loop is not None and not self._armed:  # follow the loop's lateness while it refuses
            self._armed, self._due = True, self.loop.time() + self.TICK_S
            self.loop.call_at(self._due, self._tick)
        answer = self._answers.get(limit)
        if answer is None:
            exc = OverloadedError(
                f"the server is at its limit of {limit} requests in progress; retry later",
                retry_after_s=RETRY_AFTER_S,
                detail={"limit": limit, "retry_after_s": RETRY_AFTER_S},
            )
            r = facegate_error_response(exc)
            headers = [*r.raw_headers, (b"content-security-policy", CSP.encode()), *FIXED_HEADERS]  # as every answer
            raw = [b"HTTP/1.1 503 Service Unavailable", *(k + b": " + v for k, v in headers)]
            answer = (r, b"\r\n".join(raw) + b"\r\n\r\n" + r.body)
            if len(self._answers) > 256:
                self._answers.clear()
            self._answers[limit] = answer
        return answer


#: Stands in for uvicorn's request cycle after :class:`ShedProtocol` refused a request: the rest of its body
#: is parsed and dropped (httptools, in C), and the connection stays open for the next request.
_REFUSED = types.SimpleNamespace(response_complete=True, message_event=types.SimpleNamespace(set=lambda: None))


class ShedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, which answers an ``/api/`` request past the admission bound as soon as its
    headers are parsed: one write of pre-built bytes, no task, no ASGI call (counted as ``POST unmatched``/503);
    the connection is then not read for :data:`REFUSED_PAUSE_S`. It uses uvicorn's ``HttpToolsProtocol`` internals
    (``cycle``, ``parser``, ``url``, ``flow``), which test_shed.py exercises."""

    def on_headers_complete(self) -> None:
        admission: Admission | None = self.app_state.get(STATE_KEY)
        idle = self.cycle is None or self.cycle.response_complete  # not behind a pipelined request
        # the middleware answers the rest: other paths, a drain (closing the connection), a HEAD (with no body)
        asgi = DRAIN.active or not self.url.startswith(b"/api/") or self.parser.get_method() == b"HEAD"
        if admission is None or not idle or asgi:
            return super().on_headers_complete()
        t0 = time.perf_counter()
        if (answer := admission.refuse(time.monotonic())) is None:
            return super().on_headers_complete()
        self.cycle = _REFUSED  # type: ignore[assignment]
        self.transport.write(answer[1])
        if not self.parser.should_keep_alive():
            self.transport.close()
        self.on_response_complete()
        if not self.transport.is_closing():
            # refusals as fast as clients send again would starve the admitted work of the event loop (and, in one
            # process, of the GIL)
            self.flow.pause_reading()
            self.loop.call_later(REFUSED_PAUSE_S, self.flow.resume_reading)
        admission.record(f"{self.parser.get_method().decode('ascii')} unmatched", 503, time.perf_counter() - t0)
