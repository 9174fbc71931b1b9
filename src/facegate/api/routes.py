"""HTTP routes (v1, docs/dev/http-api.md) and the state they share. None blocks the event loop: large images decode
on the decode pool, inference goes through the async FaceService (batched across requests), gallery calls run on
the gallery thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, FastAPI, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from facegate.api import schemas as sc
from facegate.api.forms import (
    EMBED_ROUTE,
    FastFormRoute,
    aligned_images,
    header,
    parse_small_multipart,
    read_body,
    replay_body,
)
from facegate.api.limits import loads_limited
from facegate.config import Settings
from facegate.errors import (
    EmptyInputError,
    EngineClosedError,
    FacegateError,
    GalleryUnavailableError,
    ImageTooLargeError,
    InvalidParameterError,
    PathNotAllowedError,
    raise_first,
)
from facegate.gallery.base import validate_subject_id
from facegate.io.decode import decode_if_small, decode_image, read_image_file
from facegate.metrics.prometheus import render_latest
from facegate.metrics.stats import ServiceStats
from facegate.service.faces import FaceService
from facegate.service.gallery import EnrolDecision, GalleryFront, decide_enrolments
from facegate.transport.remote import same_engine
from facegate.tuning import ServingPlan
from facegate.types import Face, FaceSelect

log = logging.getLogger(__name__)


@dataclass
class ServingState:
    """Everything the routes share. ``service`` and ``gallery`` are ``None`` until the lifespan made them;
    ``ready``: models warm and the engine running (the gallery may still be retried: ``gallery_error``);
    ``on_load_error``: called with ``load_error`` (``run`` shuts the server down)."""

    settings: Settings
    plan: ServingPlan
    service: FaceService | None = None
    gallery: GalleryFront | None = None
    stats: ServiceStats = field(default_factory=ServiceStats)
    decode_pool: ThreadPoolExecutor | None = None
    gallery_pool: ThreadPoolExecutor | None = None
    ready: bool = False
    load_error: FacegateError | None = None
    gallery_error: FacegateError | None = None
    gallery_task: asyncio.Task[None] | None = None
    on_load_error: Callable[[FacegateError], None] | None = None
    #: ``(socket path(s), authkey)`` of engine process(es) to use instead of loading models (front-end mode)
    engine: tuple[str | list[str], bytes] | None = None

    def require_service(self) -> FaceService:
        """The service, or raise the load error, else EngineClosedError (503)."""
        if self.ready and self.service is not None:
            return self.service
        if self.load_error is not None:
            raise self.load_error
        raise EngineClosedError("the service is starting: models are not loaded and warmed yet")

    async def in_decode_pool(self, decode: Callable[..., np.ndarray], source: Any, **kw: Any) -> np.ndarray:
        """Await ``decode(source, **kw)`` under the upload limits (``max_bytes``, ``max_pixels``) on a decode thread."""
        s = self.settings.limits
        call = functools.partial(decode, source, max_bytes=s.max_upload_bytes, max_pixels=s.max_pixels, **kw)
        return await asyncio.get_running_loop().run_in_executor(self.decode_pool, call)

    async def in_gallery_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.gallery_pool, fn, *args)


def get_state(app: Any) -> ServingState:
    return app.state.facegate  # type: ignore[no-any-return]


#: The web page and its assets (index.html, app.js, style.css).
STATIC_DIR = FilePath(__file__).resolve().parent / "static"

#: A JPEG's SOI marker followed by its first segment's marker.
JPEG = b"\xff\xd8\xff"
#: Largest subject-list offset (the store's integers are 64-bit; no gallery holds more subjects).
MAX_OFFSET = 2**31 - 1


def _errors(*codes: int) -> dict[int | str, Any]:
    """The error responses documented in OpenAPI."""
    return {c: {"model": sc.ErrorResponse} for c in codes}


_IMAGE_ERRORS = _errors(400, 403, 413, 422, 500, 503, 504)
# small multipart bodies: api/forms.py; response models come from the handlers' return annotations
health = APIRouter(tags=["health"])
faces = APIRouter(route_class=FastFormRoute, tags=["faces"], responses=_IMAGE_ERRORS)
galleries = APIRouter(route_class=FastFormRoute, tags=["galleries"], responses=_errors(404, 409, 422, 500, 503))


def _ready(request: Request) -> tuple[ServingState, FaceService, GalleryFront]:
    """The state, the service and the gallery, or raise as :meth:`ServingState.require_service`, or
    GalleryUnavailableError (503)."""
    state = get_state(request.app)
    service = state.require_service()
    if state.gallery is None:
        cause = state.gallery_error
        raise GalleryUnavailableError(
            "the gallery is unavailable (retrying): " + (cause.message if cause else "not open yet"),
            detail={"cause": cause.to_dict()} if cause else {},
        )
    return state, service, state.gallery


async def read_upload(state: ServingState, file: UploadFile, *, index: int | None = None) -> bytes:
    """All bytes of one upload; ImageTooLargeError past ``max_upload_bytes`` (by the size the form parser counted,
    before any read), EmptyInputError if none."""
    max_bytes = state.settings.limits.max_upload_bytes
    detail: dict[str, Any] = {"filename": file.filename or "", "limit": max_bytes}
    if index is not None:
        detail["index"] = index
    if file.size is not None and file.size > max_bytes:
        raise ImageTooLargeError(
            f"upload of {file.size} bytes exceeds the limit of {max_bytes} bytes", detail={**detail, "bytes": file.size}
        )
    data = await file.read()
    if not data:
        raise EmptyInputError("the uploaded file is empty (0 bytes)", detail=detail)
    return data


async def decode_bytes(state: ServingState, data: bytes) -> np.ndarray:
    """An upload's bytes → ``(H, W, 3) uint8`` RGB: here when it is small (an aligned crop), else on the pool."""
    s = state.settings.limits
    small = decode_if_small(data, max_bytes=s.max_upload_bytes, max_pixels=s.max_pixels)
    return small if small is not None else await state.in_decode_pool(decode_image, data)


async def faces_of_upload(
    state: ServingState,
    service: FaceService,
    file: UploadFile,
    *,
    index: int | None = None,
    select: FaceSelect = FaceSelect.LARGEST,
    keep_crops: bool = False,
) -> list[Face]:
    """The selected faces of one uploaded photo: a JPEG's largest face in one engine trip with the engine's
    ``photo`` stage, anything else decoded and aligned here."""
    data = await read_upload(state, file, index=index)
    if service.photo_on_device and select is FaceSelect.LARGEST and not keep_crops and data[:3] == JPEG:
        return await service.photo_faces(data)
    return await service.faces(await decode_bytes(state, data), select=select, keep_crops=keep_crops)


def _check_count(state: ServingState, n: int) -> None:
    """EmptyInputError for no image, InvalidParameterError past ``max_images_per_request``."""
    limit = state.settings.limits.max_images_per_request
    if n < 1:
        raise EmptyInputError("no images given", detail={"field": "images"})
    if n > limit:
        raise InvalidParameterError(
            f"{n} images exceed the limit of {limit} per request", detail={"field": "images", "limit": limit}
        )


@health.get("/healthz")
async def healthz() -> sc.HealthResponse:
    """Process is alive (does not wait for models)."""
    return sc.HealthResponse()


@health.get("/readyz", responses=_errors(503))
async def readyz(request: Request) -> sc.ReadyResponse:
    """200 once models are loaded and warmed and the engine runs; 503 before (and after a failed load)."""
    state = get_state(request.app)
    if not (state.ready and state.service is not None and state.service.ready):
        if state.load_error is not None:
            raise EngineClosedError(
                f"not ready: startup failed ({state.load_error.code})", detail={"cause": state.load_error.to_dict()}
            )
        raise EngineClosedError("not ready: models are loading and warming up")
    return sc.ReadyResponse(model=state.service.spec.name, device=state.plan.device, precision=state.plan.precision)


@health.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition (``facegate_*``)."""
    state = get_state(request.app)
    remote = None
    engine = getattr(state.service, "engine", None)
    # a front-end (engine process, engine pool, Ray engine deployment): the engine's families come from it
    if callable(getattr(engine, "engine_samples", None)) and engine.ready:
        try:
            remote = await asyncio.wait_for(engine.engine_samples(), timeout=5.0)
        except (FacegateError, TimeoutError):
            log.warning("engine metrics unavailable for this scrape")
    labels = state.settings.security.metrics_gallery_labels
    body, content_type = render_latest(state.stats, remote, gallery_labels=labels)
    return Response(body, media_type=content_type)


@health.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> Response:
    """The web page (compare + gallery tabs, shipped as package data); its assets are served under ``/static``."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8")


@faces.post("/api/compare", response_model_exclude_unset=True)
async def compare(
    request: Request,
    img1: Annotated[UploadFile, File(description="first photo")],
    img2: Annotated[UploadFile, File(description="second photo")],
    crops: Annotated[bool, Query(description="include the aligned crops as PNG data URLs")] = False,
) -> sc.CompareResponse:
    """Compare the largest face of two photos. Refused (never compared) when either face fails the gate."""
    state = get_state(request.app)
    service = state.require_service()

    async def one(file: UploadFile, i: int) -> Face:
        return (await faces_of_upload(state, service, file, index=i, keep_crops=crops))[0]

    # both photos to one engine process: the answer needs both, and would wait for the slower of two engines
    with same_engine():
        results = await asyncio.gather(one(img1, 0), one(img2, 1), return_exceptions=True)
    raise_first(results, ("img1", "img2"))
    res = service.compare(*results)  # type: ignore[arg-type]
    return sc.CompareResponse.from_result(res, model=service.spec.name, crops=crops)


@faces.post("/api/embed", response_model_exclude_unset=True)
async def embed(
    request: Request,
    images: Annotated[list[UploadFile] | None, File(description="1..max_images_per_request photos")] = None,
    paths: Annotated[list[str] | None, Form(description="server-side files inside the allowed roots")] = None,
    select: Annotated[Literal["largest", "all"], Form(description="which faces of each image")] = "largest",
    aligned: Annotated[bool, Form(description="inputs are aligned 112×112 crops (no detection)")] = False,
) -> sc.EmbedResponse:
    """Embeddings (+ quality verdicts) for each image; one bad image does not fail the others."""
    return await embed_response(get_state(request.app), images, paths, select, aligned)


async def embed_response(
    state: ServingState,
    images: list[UploadFile] | None,
    paths: list[str] | None,
    select: Literal["largest", "all"],
    aligned: bool,
) -> sc.EmbedResponse:
    """What ``POST /api/embed`` answers for these form values (the aligned-crop fast path calls it too)."""
    service = state.require_service()
    if images and paths:
        raise InvalidParameterError("give either 'images' or 'paths', not both", detail={"field": "images/paths"})
    n = len(images or paths or [])
    _check_count(state, n)

    async def one(i: int) -> list[Face]:
        if images and not aligned:
            return await faces_of_upload(state, service, images[i], index=i, select=FaceSelect(select))
        if images:
            image = await decode_bytes(state, await read_upload(state, images[i], index=i))
        else:  # a server-side file inside the allowed roots
            roots = state.settings.limits.allowed_roots
            image = await state.in_decode_pool(read_image_file, paths[i], allowed_roots=roots)  # type: ignore[index]
        if aligned:
            return [await service.face_aligned(image)]
        return await service.faces(image, select=FaceSelect(select))

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    for r in results:  # access control is per request, not per item: any path outside the roots fails it
        if isinstance(r, PathNotAllowedError):
            raise r
    items: list[sc.EmbedItem] = []
    for i, r in enumerate(results):
        if isinstance(r, FacegateError):
            items.append(sc.EmbedItem(index=i, error=sc.ErrorInfo(**r.to_dict())))
        elif isinstance(r, BaseException):
            raise r
        else:
            items.append(sc.EmbedItem(index=i, faces=[sc.FaceOut.from_face(f, embedding=True) for f in r]))
    return sc.EmbedResponse(model=service.spec.name, dim=service.spec.embedding_dim, results=items)


async def serve_embed_aligned(state: ServingState, scope: Scope, receive: Receive, send: Send) -> Receive | None:
    """The aligned-crop fast path of ``POST /api/embed`` below FastAPI's routing (the serving middleware calls
    it, and answers its FacegateErrors): answers a form that :func:`~facegate.api.forms.aligned_images` takes
    through :func:`embed_response` (returns None, as for a body that did not arrive), else returns a receive that
    replays the body."""
    if (body := await read_body(receive)) is None:
        return None
    ctype = header(scope, b"content-type").decode("latin-1")
    images = aligned_images(parse_small_multipart(body, ctype), state.settings.limits.max_images_per_request)
    if images is None:
        return replay_body(body, receive)
    scope["route"] = EMBED_ROUTE
    async with scope["app"].state.facegate_pixels.hold(images):
        out = await embed_response(state, images, None, "largest", True)
    payload = out.model_dump_json(by_alias=True, exclude_unset=True)
    await Response(payload, media_type="application/json")(scope, receive, send)
    return None


@faces.post("/api/detect", response_model_exclude_unset=True)
async def detect(request: Request, image: Annotated[UploadFile, File(description="a photo")]) -> sc.DetectResponse:
    """Face boxes, landmarks and scores (no embedding); an image without faces gives an empty list."""
    state = get_state(request.app)
    service = state.require_service()
    img = await decode_bytes(state, await read_upload(state, image))
    dets = await service.detect(img)
    return sc.DetectResponse(faces=[d.to_dict() for d in dets], width=img.shape[1], height=img.shape[0])


@galleries.post("/api/galleries", status_code=201)
async def create_gallery(request: Request, body: sc.CreateGalleryRequest) -> sc.GalleryOut:
    """Create an empty gallery for the served model (its name and embedding dimension are recorded)."""
    state, service, gallery = _ready(request)
    spec = service.spec
    info = await state.in_gallery_pool(gallery.store.create_gallery, body.name, spec.name, spec.embedding_dim)
    return sc.GalleryOut(**info.to_dict())


@galleries.get("/api/galleries")
async def list_galleries(request: Request) -> sc.GalleryListResponse:
    """All galleries."""
    state, _, gallery = _ready(request)
    infos = await state.in_gallery_pool(gallery.store.list_galleries)
    return sc.GalleryListResponse(galleries=[sc.GalleryOut(**i.to_dict()) for i in infos])


@galleries.delete("/api/galleries/{name}")
async def delete_gallery(request: Request, name: str) -> sc.Deleted:
    """Delete a gallery and every subject and embedding in it."""
    state, _, gallery = _ready(request)
    await state.in_gallery_pool(gallery.store.delete_gallery, name)
    return sc.Deleted(deleted=name)


async def _gallery_for_service(state: ServingState, gallery: GalleryFront, name: str) -> Any:
    """The gallery's info, checked against the served model (404 if missing, 409 if another model)."""
    info = await state.in_gallery_pool(gallery.store.get_gallery, name)
    gallery.check_model(info)
    return info


async def _enrolment_decisions(
    state: ServingState, service: FaceService, images: list[UploadFile], subject_ids: list[str]
) -> list[tuple[str, list[int], EnrolDecision]]:
    """The enrolment gate per subject over the largest face of every photo (photo ``i`` shows ``subject_ids[i]``):
    per subject, its photos' indices and its decision."""

    async def one(i: int) -> Face:
        return (await faces_of_upload(state, service, images[i], index=i))[0]

    results = await asyncio.gather(*(one(i) for i in range(len(images))), return_exceptions=True)
    verdict = service.pipeline.enrol_verdict if state.settings.quality.enrol_requires_quality else None
    return decide_enrolments(subject_ids, results, verdict=verdict, stats=state.stats)


@galleries.post("/api/galleries/{name}/subjects/{subject_id}", responses=_IMAGE_ERRORS)
async def enrol(
    request: Request,
    name: str,
    subject_id: Annotated[str, Path(description="the caller's id for this person")],
    images: Annotated[list[UploadFile], File(description="1..max_images_per_request photos of the subject")],
    meta: Annotated[str | None, Form(description="JSON object stored with the subject")] = None,
) -> sc.EnrolResponse:
    """Enrol (or add images to) a subject. Faces below the quality gate are refused and listed
    (unless ``enrol_requires_quality`` is off); 422 ``low_quality`` when no image passes."""
    state, service, gallery = _ready(request)
    validate_subject_id(subject_id, new=True)
    meta_obj = loads_limited(meta, state.settings.limits, field="meta") if meta else None  # bounded
    if meta and not isinstance(meta_obj, dict):
        raise InvalidParameterError("meta must be a JSON object", detail={"field": "meta"})
    _check_count(state, len(images))
    await _gallery_for_service(state, gallery, name)
    [(_, _, decision)] = await _enrolment_decisions(state, service, images, [subject_id] * len(images))
    refused = [sc.RefusedImage(index=x.index, reason=x.reason, code=x.code) for x in decision.refused]
    if decision.error is not None:
        raise decision.error
    [info] = await state.in_gallery_pool(gallery.store.enrol_many, name, [(subject_id, *decision.stacked(), meta_obj)])
    return sc.EnrolResponse(subject=info.to_dict(), accepted=len(decision.accepted), refused=refused)


@galleries.post("/api/galleries/{name}/enrolments", responses=_IMAGE_ERRORS)
async def enrol_batch(
    request: Request,
    name: str,
    images: Annotated[list[UploadFile], File(description="photos of several subjects")],
    subject_ids: Annotated[str, Form(description="JSON list: the subject of each photo, in order")],
) -> sc.BatchEnrolResponse:
    """Enrol several subjects in one request: every photo goes through the engine at once (batched with
    other requests), the request's subjects are written in one transaction, refused photos are listed."""
    state, service, gallery = _ready(request)
    ids = loads_limited(subject_ids, state.settings.limits, field="subject_ids")
    if not isinstance(ids, list) or len(ids) != len(images):
        raise InvalidParameterError(
            "subject_ids must be a JSON list with one id per image", detail={"field": "subject_ids"}
        )
    ids = [validate_subject_id(x, new=True) for x in ids]
    _check_count(state, len(images))
    await _gallery_for_service(state, gallery, name)
    todo: list[tuple[str, np.ndarray, np.ndarray, None]] = []
    refused: list[sc.BatchRefusal] = []
    for sid, rows, decision in await _enrolment_decisions(state, service, images, ids):
        refused += [
            sc.BatchRefusal(index=rows[x.index], subject_id=sid, reason=x.reason, code=x.code) for x in decision.refused
        ]
        if decision.error is None:
            todo.append((sid, *decision.stacked(), None))
    infos = await state.in_gallery_pool(gallery.store.enrol_many, name, todo) if todo else []
    return sc.BatchEnrolResponse(
        enrolled=[sc.SubjectOut(**i.to_dict()) for i in infos], refused=sorted(refused, key=lambda r: r.index)
    )


@galleries.post("/api/galleries/{name}/templates")
async def import_templates(request: Request, name: str, body: sc.ImportTemplatesRequest) -> sc.ImportTemplatesResponse:
    """Bulk-enrol up to 10,000 subjects from templates (e.g. from ``facegate embed``) in one transaction;
    a subject that exists starts over from its imported template."""
    state, _, gallery = _ready(request)
    info = await _gallery_for_service(state, gallery, name)
    # checked row by row before NumPy sees them: rows of unequal lengths make no array (a ValueError, a 500)
    if len(body.embeddings) != len(body.subject_ids) or any(len(r) != info.dim for r in body.embeddings):
        raise InvalidParameterError(
            f"embeddings must be {len(body.subject_ids)} rows of {info.dim} numbers",
            detail={"field": "embeddings", "expected": [len(body.subject_ids), info.dim]},
        )
    emb = np.asarray(body.embeddings, dtype=np.float32)
    emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    qual = None if body.qualities is None else np.asarray(body.qualities, dtype=np.float32)
    n = await state.in_gallery_pool(gallery.store.import_templates, name, body.subject_ids, emb, qual)
    return sc.ImportTemplatesResponse(imported=n)


@galleries.get("/api/galleries/{name}/subjects")
async def list_subjects(
    request: Request,
    name: str,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> sc.SubjectListResponse:
    """A page of subjects (ordered by id) and the gallery's total."""
    state, _, gallery = _ready(request)
    info = await state.in_gallery_pool(gallery.store.get_gallery, name)
    subjects = await state.in_gallery_pool(gallery.store.list_subjects, name, offset, limit)
    return sc.SubjectListResponse(subjects=[sc.SubjectOut(**x.to_dict()) for x in subjects], total=info.subjects)


@galleries.delete("/api/galleries/{name}/subjects/{subject_id}")
async def delete_subject(request: Request, name: str, subject_id: str) -> sc.Deleted:
    """Erase a subject and all its embeddings."""
    state, _, gallery = _ready(request)
    await state.in_gallery_pool(gallery.store.delete_subject, name, subject_id)
    return sc.Deleted(deleted=subject_id)


@galleries.post("/api/galleries/{name}/search", responses=_IMAGE_ERRORS, response_model_exclude_unset=True)
async def search(
    request: Request,
    name: str,
    image: Annotated[UploadFile, File(description="the probe photo")],
    k: Annotated[int, Query(ge=1, le=100, description="how many candidates")] = 5,
    fpir: Annotated[
        float | None,
        Query(gt=0, lt=1, description="false-positive identification rate the match threshold is set for"),
    ] = None,
) -> sc.SearchResponse:
    """1:N search with the largest face, on the engine's index. A probe below the quality gate is refused,
    never searched. The match threshold is set for ``fpir`` (default 1e-2) at the gallery's current size."""
    state, service, gallery = _ready(request)
    found = None
    data = await read_upload(state, image) if service.photo_on_device else None
    if data is not None and data[:3] == JPEG:
        # photo -> face -> embedding -> search in one engine trip, which also checks the gallery
        faces, found = await service.photo_search(data, name, k)
        face, n = faces[0], found.size
    else:
        n = (await _gallery_for_service(state, gallery, name)).subjects  # before the upload is read when off the device
        data = data or await read_upload(state, image)
        face = (await service.faces(await decode_bytes(state, data)))[0]
    hits, point = await gallery.search_face(name, face, k, fpir, found=found, size=n)
    point = {k: point[k] for k in ("threshold", "fmr", "fpir", "n", "extrapolated")}
    refused = not face.quality.accepted
    reason = face.quality.reason  # None when accepted
    return sc.SearchResponse(face=sc.FaceOut.from_face(face), refused=refused, reason=reason, hits=hits, **point)


def install_routes(app: FastAPI) -> None:
    """Add every route to ``app``, and the page's assets under ``/static``."""
    for router in (health, faces, galleries):
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")
