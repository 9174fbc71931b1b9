"""The HTTP application: app factory, lifespan and the request middleware.

The lifespan loads in the background (``/healthz`` answers at once, ``/readyz`` 503 until the service is built,
the gallery open and the engine warm) and stops in order. :class:`ServingMiddleware` is pure ASGI: no task hops,
no body buffering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from facegate import __version__
from facegate.api.drain import DRAIN, UVICORN_MARGIN_S, shutting_down, watch_signals
from facegate.api.errors import facegate_error_response, install_error_handlers, internal_error_response
from facegate.api.forms import header, read_body, replay_body, wants_fast_path
from facegate.api.limits import (
    STATE_KEY,
    TEMPLATES_ROUTE,
    Admission,
    PixelBudget,
    ShedProtocol,
    import_max_bytes,
    is_json,
    loads_limited,
)
from facegate.api.routes import ServingState, get_state, install_routes, serve_embed_aligned
from facegate.api.security import CSP, Access, install_docs, install_openapi_security, with_security_headers
from facegate.config import Settings
from facegate.errors import (
    BodyTooLargeError,
    DeadlineExceededError,
    FacegateError,
    GalleryError,
    GalleryUnavailableError,
    ImageTooLargeError,
    InputError,
    ModelError,
)
from facegate.gallery import open_store
from facegate.logs import escape
from facegate.service.faces import FaceService
from facegate.service.gallery import GalleryFront
from facegate.service.keys import KeyStore
from facegate.tuning import ServingPlan, make_plan

log = logging.getLogger(__name__)


#: Bytes a multipart body may carry on top of its images (boundaries, part headers, small form fields).
MULTIPART_SLACK_BYTES = 256 * 1024
#: Largest body of a route that takes no image (JSON bodies, empty bodies).
SMALL_BODY_BYTES = 1024 * 1024
#: Status recorded when the client went away before the response started (nginx's convention).
CLIENT_CLOSED_STATUS = 499


def open_gallery(settings: Settings, service: FaceService, open_retry_s: float) -> GalleryFront:
    """Open this front-end's connection to the gallery store (no templates: searches run on the engine's index),
    retrying a busy or unreachable store for ``open_retry_s``."""
    store = open_store(settings.gallery_url, data_dir=settings.data_dir, open_retry_s=open_retry_s)
    try:
        return GalleryFront(store, service)
    except BaseException:
        store.close()
        raise


async def _load(state: ServingState) -> None:
    """Build (when not given) and start the service, open the gallery; sets ``state.ready``."""
    settings = state.settings
    t0 = time.perf_counter()
    try:
        if state.service is None and state.engine is not None:
            log.info("connecting to the engine process at %s", state.engine[0])
            state.service = await asyncio.to_thread(FaceService.connect, settings, *state.engine, state.plan)
        elif state.service is None:
            log.info("loading models (model=%s device=%s)", settings.model, state.plan.device)
            state.service = await asyncio.to_thread(FaceService.build, settings, state.plan)
        state.stats = state.service.stats
        try:
            retry = settings.gallery_open_retry_s
            state.gallery = await state.in_gallery_pool(open_gallery, settings, state.service, retry)
        except GalleryError as exc:
            busy = str(exc.detail.get("sqlite_errorname", "")).startswith(("SQLITE_BUSY", "SQLITE_LOCKED"))
            if not (busy or isinstance(exc, GalleryUnavailableError)):  # not transient
                raise
            # a file another process keeps locked, a database out of reach: serve what needs no gallery, retry
            log.error("the gallery is unavailable (%s); serving without it and retrying", exc.message)
            state.gallery_error = exc
            state.gallery_task = asyncio.create_task(_reopen_gallery(state), name="facegate-gallery-open")
        await state.service.start()  # warms the models off the loop, then starts the engine
        state.ready = True  # (until the shutdown: the service runs)
        log.info("ready in %.2f s: model=%s", time.perf_counter() - t0, state.service.spec.name)
    except InputError as exc:  # a bad setting: the server's fault, not the clients' (500, not 4xx)
        _load_failed(state, ModelError(f"startup failed: {exc.message}", detail={"cause": exc.to_dict()}))
    except FacegateError as exc:
        _load_failed(state, exc)
    except Exception as exc:  # a third-party failure while loading: keep serving /healthz, report it
        log.exception("startup failed")
        _load_failed(state, ModelError(f"startup failed: {type(exc).__name__}: {exc}"))


#: Seconds between background attempts to open a gallery that was busy at start-up.
GALLERY_REOPEN_S = 5.0


async def _reopen_gallery(state: ServingState) -> None:
    """Retry opening the gallery until it opens (meanwhile its routes answer 503 gallery_unavailable)."""
    while state.gallery is None:
        await asyncio.sleep(GALLERY_REOPEN_S)
        try:  # short attempts, so that a shutdown never waits long for one on the gallery thread
            retry = min(GALLERY_REOPEN_S, state.settings.gallery_open_retry_s)
            state.gallery = await state.in_gallery_pool(open_gallery, state.settings, state.service, retry)
        except FacegateError as exc:
            state.gallery_error = exc
            log.warning("the gallery is still unavailable: %s", exc.message)
    state.gallery_error = None
    log.info("the gallery is open")


def _load_failed(state: ServingState, exc: FacegateError) -> None:
    state.load_error = exc
    log.error("startup failed: %s: %s", exc.code, exc.message)
    if state.on_load_error is not None:
        state.on_load_error(exc)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Pools up, background load + warm, and an orderly shutdown."""
    state = get_state(app)
    workers = state.plan.decode_workers
    state.decode_pool = ThreadPoolExecutor(workers, thread_name_prefix="facegate-decode")
    state.gallery_pool = ThreadPoolExecutor(min(4, workers), thread_name_prefix="facegate-gallery")
    load = asyncio.create_task(_load(state), name="facegate-load")
    watch_signals(state.settings.drain_s, asyncio.get_running_loop())  # after uvicorn installed its handlers
    if state.engine is not None:  # a front-end: connecting takes well under a second; accept only once connected,
        await asyncio.shield(load)  # so no worker answers 503 while its siblings already serve
    try:
        yield
    finally:
        started, state.ready = state.ready, False
        if state.gallery_task is not None:
            state.gallery_task.cancel()
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        if started:
            try:
                if DRAIN.active:  # every request is answered (or was cut short): queued work has nobody waiting
                    await asyncio.to_thread(state.service.engine.stop, False)
                await state.service.stop()
            except Exception:
                log.exception("stopping the face service failed")
        if state.gallery is not None:
            try:
                await state.in_gallery_pool(state.gallery.store.close)
            except Exception:
                log.exception("closing the gallery failed")
        state.decode_pool.shutdown(wait=False, cancel_futures=True)
        state.gallery_pool.shutdown(wait=True, cancel_futures=True)
        log.info("facegate stopped")


#: POST routes that take images, and how many (0: up to ``limits.max_images_per_request``).
_IMAGE_ROUTES: list[tuple[re.Pattern[str], int]] = [
    (re.compile(r"^/api/compare/?$"), 2),
    (re.compile(r"^/api/detect/?$"), 1),
    (re.compile(r"^/api/galleries/[^/]+/search/?$"), 1),
    (re.compile(r"^/api/embed/?$"), 0),
    (re.compile(r"^/api/galleries/[^/]+/subjects/[^/]+/?$"), 0),
    (re.compile(r"^/api/galleries/[^/]+/enrolments/?$"), 0),
]


def body_limit(settings: Settings, method: str, path: str) -> int:
    """Largest request body (bytes) the route at ``method path`` can accept."""
    for pattern, n in _IMAGE_ROUTES:
        if method == "POST" and pattern.match(path):
            n = n or settings.limits.max_images_per_request
            return n * settings.limits.max_upload_bytes + MULTIPART_SLACK_BYTES
    if method == "POST" and TEMPLATES_ROUTE.match(path):
        return import_max_bytes(settings)
    return SMALL_BODY_BYTES


class ServingMiddleware:
    """What every HTTP request meets, in order: the drain, the route's body limit, the access checks; for
    ``/api/`` routes the admission bound, then under the deadline the JSON limits (:mod:`facegate.api.limits`) and
    the aligned-crop fast path. Around it all: the security headers (``docs_csp``: the doc pages' policies),
    disconnect → cancel, the drain's cut, request metrics, the catch-all."""

    def __init__(self, app: ASGIApp, state: ServingState, access: Access, docs_csp: dict[str, str]) -> None:
        self.app, self.state, self.access, self.docs_csp = app, state, access, docs_csp
        self.admission = Admission(state.settings, state.plan.admission_queue_s)
        self.admission.record = self._record_route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan" and "state" in scope:
                scope["state"][STATE_KEY] = self.admission  # uvicorn hands this dict to its protocols
                self.admission.loop = asyncio.get_running_loop()
            await self.app(scope, receive, send)
            return
        send = with_security_headers(send, self.docs_csp.get(scope["path"], CSP))  # on every answer, errors included
        if DRAIN.active:
            await shutting_down("the server is shutting down; retry on another replica or later")(scope, receive, send)
            return
        t0 = time.perf_counter()
        task = asyncio.current_task()
        assert task is not None
        limit = body_limit(self.state.settings, scope["method"], scope["path"])
        # FastAPI's routes take no HEAD: the app answers a GET, and uvicorn (reading its own scope) drops the body
        app_scope = {**scope, "method": "GET"} if scope["method"] == "HEAD" else scope
        status = 500
        response_started = False
        too_large = False
        received = 0
        disconnected = asyncio.Event()
        cancelled_by_disconnect = False
        watcher: asyncio.Task[None] | None = None
        adm, limits, admitted = self.admission, self.state.settings.limits, False

        async def watch_disconnect() -> None:
            nonlocal cancelled_by_disconnect
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    if not response_started:
                        cancelled_by_disconnect = True
                        task.cancel()
                    return

        async def wrapped_receive() -> Message:
            nonlocal received, too_large, watcher
            if watcher is not None or disconnected.is_set():  # the body is over: only a disconnect can come now
                await disconnected.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    too_large = True
                    disconnected.set()
                    return {"type": "http.disconnect"}  # stops the body parser; we answer 413 below
                if not message.get("more_body", False):
                    watcher = asyncio.create_task(watch_disconnect())  # reads the disconnect from now on
            elif message["type"] == "http.disconnect":
                disconnected.set()
            return message

        async def wrapped_send(message: Message) -> None:
            nonlocal status, response_started
            if too_large:
                return  # the app's answer to the aborted body is replaced by our 413
            if message["type"] == "http.response.start":
                response_started = True
                status = int(message["status"])
            await send(message)

        try:
            DRAIN.tasks.add(task)  # cut short if the drain expires meanwhile
            try:
                declared = header(scope, b"content-length")
                if declared.isdigit() and int(declared) > limit:
                    raise _too_large(scope, int(declared), limit)
                if (refused := self.access.refusal(scope)) is not None:
                    raise refused
                if api := scope["path"].startswith("/api/"):
                    now = time.monotonic()
                    if (shed := adm.refuse(now)) is not None:
                        await shed[0](scope, receive, wrapped_send)
                        return
                    if adm.admitted == 0:
                        adm.busy(now)
                    adm.admitted, admitted = adm.admitted + 1, True
                deadline_s = limits.request_timeout_s - (time.perf_counter() - t0) if api else None
                async with asyncio.timeout(deadline_s):  # covers the upload: a stalled body must free its slot
                    app_receive: Receive | None = wrapped_receive
                    if api and scope["method"] in ("POST", "PUT", "PATCH") and is_json(scope):
                        cap = limit if TEMPLATES_ROUTE.match(scope["path"]) else limits.json_max_bytes
                        body = await read_body(wrapped_receive, cap)  # None: the client went away
                        if body:
                            loads_limited(body, limits, max_bytes=cap)
                        app_receive = None if body is None else replay_body(body, wrapped_receive)
                    if app_receive is not None and wants_fast_path(scope):  # None: answered
                        app_receive = await serve_embed_aligned(self.state, scope, app_receive, wrapped_send)
                    if app_receive is not None:
                        await self.app(app_scope, app_receive, wrapped_send)
            except TimeoutError:
                deadline = limits.request_timeout_s
                log.info("%s %s: deadline of %.1f s passed", scope["method"], escape(scope["path"]), deadline)
                if not response_started and not too_large:
                    msg = f"the request did not finish within its deadline of {deadline:g} s"
                    exc = DeadlineExceededError(msg, detail={"deadline_s": deadline})
                    await facegate_error_response(exc)(scope, receive, wrapped_send)
            except FacegateError as exc:  # the checks above, the fast path's and the routes' errors
                if response_started:
                    raise
                if not too_large:
                    await facegate_error_response(exc)(scope, receive, wrapped_send)
            except asyncio.CancelledError:
                if not (cancelled_by_disconnect or DRAIN.expired):  # not our cancel: the server's
                    raise
                status = CLIENT_CLOSED_STATUS if cancelled_by_disconnect else 503  # the client's, or the drain's cut
                if task.uncancel() > 0:  # cancelled by someone else as well (server shutdown): propagate
                    raise
                if cancelled_by_disconnect:
                    log.info("%s %s: client disconnected; request cancelled", scope["method"], escape(scope["path"]))
                elif not response_started:
                    await shutting_down("the server shut down before this request finished")(scope, receive, send)
                return
            except Exception:
                log.exception("unhandled error in %s %s", scope["method"], escape(scope["path"]))
                if not response_started and not too_large:
                    await internal_error_response()(scope, receive, wrapped_send)
                    return
                if not too_large:
                    raise
            if too_large and not response_started:  # past wrapped_send, which drops the app's answer
                response = facegate_error_response(_too_large(scope, received, limit))
                status = response.status_code
                await response(scope, receive, send)
        finally:
            DRAIN.tasks.discard(task)
            if status == 500 and not response_started and disconnected.is_set():  # nobody left to answer
                status = CLIENT_CLOSED_STATUS
            if admitted:
                adm.admitted -= 1
                if 200 <= status < 400:  # the rate of work done: quick refusals would overstate it
                    adm.finished(time.monotonic())
            if watcher is not None and not watcher.done():
                watcher.cancel()
            template = getattr(app_scope.get("route"), "path", None) or "unmatched"
            self._record_route(f"{scope['method']} {template}", status, time.perf_counter() - t0)

    def _record_route(self, route: str, status: int, seconds: float) -> None:
        try:
            self.state.stats.record_request(route, status, seconds)
        except Exception:  # metrics must never fail a request
            log.exception("recording request metrics failed")


def _too_large(scope: Scope, size: int, limit: int) -> ImageTooLargeError:
    images = scope["method"] == "POST" and any(p.match(scope["path"]) for p, _ in _IMAGE_ROUTES)
    return (ImageTooLargeError if images else BodyTooLargeError)(
        f"request body of {size} bytes exceeds the {limit} bytes this route accepts",
        detail={"bytes": size, "limit": limit},
    )


def create_app(
    settings: Settings,
    service: FaceService | None = None,
    *,
    engine: tuple[str | list[str], bytes] | None = None,
    plan: ServingPlan | None = None,
) -> FastAPI:
    """The facegate HTTP app (OpenAPI at ``/docs``). ``service``: use it instead of building the models (the
    lifespan starts it); ``engine``: ``(socket path(s), authkey)`` of running engine processes (a front-end)."""
    plan = plan or make_plan(settings)
    state = ServingState(settings, plan, service, engine=engine)  # (the lifespan takes the service's stats)
    app = FastAPI(
        title="facegate",
        version=__version__,
        description="Face recognition with a built-in quality gate. Errors: "
        '`{"error": {"code", "message", "detail"}}`.',
        lifespan=lifespan,
        docs_url=None,  # served from packaged assets by facegate.api.security (works offline)
        redoc_url=None,
    )
    app.state.facegate = state
    app.state.facegate_pixels = PixelBudget(settings.limits)
    install_error_handlers(app)
    install_routes(app)
    install_openapi_security(app, settings)
    keys = KeyStore(settings.data_dir, settings.security.keys_file)
    app.add_middleware(ServingMiddleware, state=state, access=Access(settings, keys), docs_csp=install_docs(app))
    return app


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> Any:
    """The one uvicorn configuration of every serving process, on ``settings``' host and port."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        log_config=None,  # keep the process's logging setup (the CLI configures it)
        access_log=False,
        http=ShedProtocol,  # httptools, refusing past the admission bound before any task (api.limits)
        timeout_graceful_shutdown=settings.drain_s + UVICORN_MARGIN_S,
        **overrides,
    )
