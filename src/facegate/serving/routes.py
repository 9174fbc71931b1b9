"""HTTP routes (v1, docs/dev/http-api.md).

Every route is ``async`` and never blocks the event loop: uploads are read with ``await file.read()``
(bounded by ``settings.max_upload_bytes``), images are decoded on the decode thread pool, inference goes
through the async :class:`~facegate.pipeline.service.FaceService` (batched across requests by the engine)
and gallery calls run on the gallery thread. Routes raise :class:`~facegate.errors.FacegateError`
subclasses; :mod:`facegate.serving.errors` turns them into HTTP responses.

The quality gate is visible everywhere: every face carries its verdict, compare refuses (never compares
silently) when either face is below the gate, enrolment refuses low-quality faces by default and lists
them, and search refuses a low-quality probe instead of searching with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Sequence
from pathlib import Path as FilePath
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import numpy as np
from fastapi import APIRouter, FastAPI, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from facegate.engine.remote import same_engine
from facegate.errors import (
    EmptyInputError,
    FacegateError,
    ImageTooLargeError,
    InvalidParameterError,
    PathNotAllowedError,
    QualityRejectedError,
)
from facegate.serving.app import ServingState, get_state
from facegate.serving.errors import error_dict
from facegate.serving.forms import FastFormRoute
from facegate.serving.schemas import (
    CompareResponse,
    CreateGalleryRequest,
    DeletedGallery,
    DeletedSubject,
    DetectionOut,
    DetectResponse,
    EmbedItem,
    EmbedResponse,
    EnrolResponse,
    ErrorInfo,
    ErrorResponse,
    FaceOut,
    GalleryListResponse,
    GalleryOut,
    HealthResponse,
    ReadyResponse,
    RefusedImage,
    SearchHit,
    SearchResponse,
    SubjectListResponse,
    SubjectOut,
)
from facegate.types import Face, FaceSelect

if TYPE_CHECKING:
    from facegate.pipeline.service import FaceService

log = logging.getLogger(__name__)

T = TypeVar("T")

router = APIRouter(route_class=FastFormRoute)  # small multipart bodies: serving/forms.py

#: The web page and its assets (index.html, app.js, style.css).
STATIC_DIR = FilePath(__file__).resolve().parent / "static"

#: Error responses documented in OpenAPI for routes that take images.
_IMAGE_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 403, 413, 422, 500, 503, 504)
}
_GALLERY_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (404, 409, 422, 500, 503)
}


def _state(request: Request) -> ServingState:
    return get_state(request.app)


# --------------------------------------------------------------------------- helpers
async def read_upload(file: UploadFile, max_bytes: int, *, index: int | None = None) -> bytes:
    """All bytes of one uploaded file, refusing more than ``max_bytes`` without reading them all.

    Raises:
        ImageTooLargeError: the part is larger than ``max_bytes``.
        EmptyInputError: the part has zero bytes.
    """
    detail: dict[str, Any] = {"field": file.filename or "", "limit": max_bytes}
    if index is not None:
        detail["index"] = index
    if file.size is not None and file.size > max_bytes:
        raise ImageTooLargeError(
            f"upload of {file.size} bytes exceeds the limit of {max_bytes} bytes", detail={**detail, "bytes": file.size}
        )
    data = await file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ImageTooLargeError(f"upload exceeds the limit of {max_bytes} bytes", detail=detail)
    if not data:
        raise EmptyInputError("the uploaded file is empty (0 bytes)", detail=detail)
    return data


async def decode_bytes(state: ServingState, data: bytes) -> np.ndarray:
    """Decode an upload's bytes → ``(H, W, 3) uint8`` RGB: right here when its header says it is no larger than
    :data:`~facegate.io.decode.INLINE_DECODE_PIXELS` (an aligned crop), else on the decode pool."""
    from facegate.io.decode import decode_if_small, decode_image

    s = state.settings
    small = decode_if_small(data, max_bytes=s.max_upload_bytes, max_pixels=s.max_pixels)
    if small is not None:
        return small
    return await state.in_decode_pool(decode_image, data, max_bytes=s.max_upload_bytes, max_pixels=s.max_pixels)


async def decode_upload(state: ServingState, file: UploadFile, *, index: int | None = None) -> np.ndarray:
    """Read and decode one upload → ``(H, W, 3) uint8`` RGB (decoding on the decode pool)."""
    return await decode_bytes(state, await read_upload(file, state.settings.max_upload_bytes, index=index))


async def faces_of_upload(
    state: ServingState,
    service: FaceService,
    file: UploadFile,
    *,
    index: int | None = None,
    select: FaceSelect = FaceSelect.LARGEST,
    keep_crops: bool = False,
) -> list[Face]:
    """The selected faces of one uploaded photo.

    With the engine's ``photo`` stage (``Settings.gpu_preprocess``) the largest face of a JPEG is found from
    the upload's bytes on the engine's device, in one engine trip. Other formats (which nvJPEG does not
    decode, so the engine process would decode them on its CPU) and other requests (every face, or the
    crops in the answer) are decoded and aligned here.
    """
    if not (service.photo_on_device and select is FaceSelect.LARGEST and not keep_crops):
        image = await decode_upload(state, file, index=index)
        return await service.faces(image, select=select, keep_crops=keep_crops)
    data = await read_upload(file, state.settings.max_upload_bytes, index=index)
    if data[:3] == b"\xff\xd8\xff":  # a JPEG's SOI marker followed by its first segment's marker
        return await service.photo_faces(data)
    return await service.faces(await decode_bytes(state, data), select=select)


async def decode_path(state: ServingState, path: str) -> np.ndarray:
    """Read and decode one server-side file inside ``settings.allowed_roots`` (on the decode pool)."""
    from facegate.io.decode import read_image_file

    s = state.settings
    return await state.in_decode_pool(
        read_image_file, path, allowed_roots=s.allowed_roots, max_bytes=s.max_upload_bytes, max_pixels=s.max_pixels
    )


async def gather_all(aws: Sequence[Awaitable[T]]) -> list[T | BaseException]:
    """Run awaitables concurrently and wait for *all* of them; results or exceptions, in input order.

    If the caller is cancelled (client disconnect), every child task is cancelled too, so no work is left
    running for a request nobody waits for.
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    out: list[T | BaseException] = []
    for t in tasks:
        exc = t.exception()
        out.append(exc if exc is not None else t.result())
    return out


def first_error(results: Sequence[Any]) -> None:
    """Raise the first exception in ``results`` (input order), if any."""
    for r in results:
        if isinstance(r, BaseException):
            raise r


def _check_count(n: int, limit: int, what: str) -> None:
    if n < 1:
        raise EmptyInputError(f"no {what} given", detail={"field": what})
    if n > limit:
        raise InvalidParameterError(
            f"{n} {what} exceed the limit of {limit} per request", detail={"field": what, "limit": limit}
        )


def _refusal_reason(face: Face) -> str:
    return face.quality.reason or f"quality {face.quality.score:.2f} is below the gate {face.quality.threshold:.2f}"


def _record_refusal(state: ServingState, reason: str) -> None:
    state.stats.record_refusal(reason)


# --------------------------------------------------------------------------- health
@router.get("/healthz", response_model=HealthResponse, tags=["health"])
async def healthz() -> HealthResponse:
    """Process is alive (does not wait for models)."""
    return HealthResponse()


@router.get("/readyz", response_model=ReadyResponse, responses={503: {"model": ErrorResponse}}, tags=["health"])
async def readyz(request: Request) -> ReadyResponse:
    """200 once models are loaded and warmed and the engine runs; 503 before (and after a failed load)."""
    from facegate.errors import EngineClosedError

    state = _state(request)
    if not (state.ready and state.service is not None and state.service.ready):
        if state.load_error is not None:
            raise EngineClosedError(
                f"not ready: startup failed ({state.load_error.code})", detail={"cause": state.load_error.to_dict()}
            )
        raise EngineClosedError("not ready: models are loading and warming up")
    s = state.settings
    return ReadyResponse(model=state.service.spec.name, device=s.resolved_device(), precision=s.precision)


@router.get("/metrics", response_class=PlainTextResponse, tags=["health"])
async def metrics(request: Request) -> Response:
    """Prometheus text exposition (``facegate_*``)."""
    from facegate.metrics.prometheus import render_latest

    state = _state(request)
    remote = None
    engine = getattr(state.service, "engine", None)
    # a front-end (engine process, engine pool, Ray engine deployment): the engine's families come from it
    if callable(getattr(engine, "engine_samples", None)) and engine.ready:
        try:
            remote = await asyncio.wait_for(engine.engine_samples(), timeout=5.0)
        except (FacegateError, TimeoutError):
            log.warning("engine metrics unavailable for this scrape")
    body, content_type = render_latest(state.stats, remote)
    return Response(body, media_type=content_type)


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> Response:
    """The web page (compare + gallery tabs); its assets are served under ``/static``."""
    page = STATIC_DIR / "index.html"
    if page.is_file():
        return FileResponse(page, media_type="text/html; charset=utf-8")
    return HTMLResponse("<!doctype html><title>facegate</title><p>facegate: see <a href='/docs'>/docs</a>.")


# --------------------------------------------------------------------------- faces
@router.post(
    "/api/compare",
    response_model=CompareResponse,
    response_model_exclude_unset=True,
    responses=_IMAGE_ERRORS,
    tags=["faces"],
)
async def compare(
    request: Request,
    img1: Annotated[UploadFile, File(description="first photo")],
    img2: Annotated[UploadFile, File(description="second photo")],
    crops: Annotated[bool, Query(description="include the aligned crops as PNG data URLs")] = False,
) -> CompareResponse:
    """Compare the largest face of two photos. Refused (never compared) when either face fails the gate."""
    state = _state(request)
    service = state.require_service()

    async def one(file: UploadFile, i: int) -> Face:
        return (await faces_of_upload(state, service, file, index=i, keep_crops=crops))[0]

    # both photos to one engine process (Settings.compare_same_engine): the answer needs both
    with same_engine() if state.settings.compare_same_engine else contextlib.nullcontext():
        results = await gather_all([one(img1, 0), one(img2, 1)])
    first_error(results)
    a, b = results  # type: ignore[misc]
    res = service.compare(a, b)  # type: ignore[arg-type]
    return CompareResponse.from_result(res, model=service.spec.name, crops=crops)


@router.post(
    "/api/embed",
    response_model=EmbedResponse,
    response_model_exclude_unset=True,
    responses=_IMAGE_ERRORS,
    tags=["faces"],
)
async def embed(
    request: Request,
    images: Annotated[list[UploadFile] | None, File(description="1..max_images_per_request photos")] = None,
    paths: Annotated[list[str] | None, Form(description="server-side files inside the allowed roots")] = None,
    select: Annotated[Literal["largest", "all"], Form(description="which faces of each image")] = "largest",
    aligned: Annotated[bool, Form(description="inputs are aligned 112×112 crops (no detection)")] = False,
) -> EmbedResponse:
    """Embeddings (+ quality verdicts) for each image; one bad image does not fail the others."""
    state = _state(request)
    return await embed_response(state, state.require_service(), images, paths, select, aligned)


async def embed_response(
    state: ServingState,
    service: FaceService,
    images: list[UploadFile] | None,
    paths: list[str] | None,
    select: Literal["largest", "all"],
    aligned: bool,
) -> EmbedResponse:
    """What ``POST /api/embed`` answers for these form values (the route's body; the aligned-crop fast path,
    :mod:`facegate.serving.fastpath`, calls it too)."""
    if images and paths:
        raise InvalidParameterError("give either 'images' or 'paths', not both", detail={"field": "images/paths"})
    n = len(images or paths or [])
    _check_count(n, state.settings.max_images_per_request, "images")

    async def one(i: int) -> list[Face]:
        if images and not aligned:
            return await faces_of_upload(state, service, images[i], index=i, select=FaceSelect(select))
        image = await (decode_upload(state, images[i], index=i) if images else decode_path(state, paths[i]))  # type: ignore[index]
        if aligned:
            return [await service.face_aligned(image)]
        return await service.faces(image, select=FaceSelect(select))

    results = await gather_all([one(i) for i in range(n)])
    for r in results:  # access control is per request, not per item: any path outside the roots fails it
        if isinstance(r, PathNotAllowedError):
            raise r
    items: list[EmbedItem] = []
    for i, r in enumerate(results):
        if isinstance(r, FacegateError):
            items.append(EmbedItem(index=i, error=ErrorInfo(**error_dict(r))))
        elif isinstance(r, BaseException):
            raise r
        else:
            items.append(EmbedItem(index=i, faces=[FaceOut.from_face(f, embedding=True) for f in r]))
    return EmbedResponse(model=service.spec.name, dim=service.spec.embedding_dim, results=items)


@router.post("/api/detect", response_model=DetectResponse, responses=_IMAGE_ERRORS, tags=["faces"])
async def detect(request: Request, image: Annotated[UploadFile, File(description="a photo")]) -> DetectResponse:
    """Face boxes, landmarks and scores (no embedding); an image without faces gives an empty list."""
    state = _state(request)
    service = state.require_service()
    img = await decode_upload(state, image)
    dets = await service.detect(img)
    h, w = img.shape[:2]
    return DetectResponse(faces=[DetectionOut.from_detection(d) for d in dets], width=int(w), height=int(h))


# --------------------------------------------------------------------------- galleries
def _gallery_out(info: Any) -> GalleryOut:
    return GalleryOut(**info.to_dict())


def _subject_out(info: Any) -> SubjectOut:
    return SubjectOut(**info.to_dict())


@router.post(
    "/api/galleries", status_code=201, response_model=GalleryOut, responses=_GALLERY_ERRORS, tags=["galleries"]
)
async def create_gallery(request: Request, body: CreateGalleryRequest) -> GalleryOut:
    """Create an empty gallery for the served model (its name and embedding dimension are recorded)."""
    state = _state(request)
    service, gallery = state.require_ready()
    info = await state.in_gallery_pool(gallery.create_gallery, body.name, service.spec.name, service.spec.embedding_dim)
    return _gallery_out(info)


@router.get("/api/galleries", response_model=GalleryListResponse, responses=_GALLERY_ERRORS, tags=["galleries"])
async def list_galleries(request: Request) -> GalleryListResponse:
    """All galleries."""
    state = _state(request)
    _, gallery = state.require_ready()
    infos = await state.in_gallery_pool(gallery.list_galleries)
    return GalleryListResponse(galleries=[_gallery_out(i) for i in infos])


@router.delete("/api/galleries/{name}", response_model=DeletedGallery, responses=_GALLERY_ERRORS, tags=["galleries"])
async def delete_gallery(request: Request, name: str) -> DeletedGallery:
    """Delete a gallery and every subject and embedding in it."""
    state = _state(request)
    _, gallery = state.require_ready()
    await state.in_gallery_pool(gallery.delete_gallery, name)
    return DeletedGallery(deleted=name)


async def _gallery_for_service(state: ServingState, name: str) -> Any:
    """The gallery's info, checked against the served model (404 if missing, 409 if another model)."""
    from facegate.errors import DimensionMismatchError

    service, gallery = state.require_ready()
    info = await state.in_gallery_pool(gallery.get_gallery, name)
    if info.model != service.spec.name or info.dim != service.spec.embedding_dim:
        raise DimensionMismatchError(
            f"gallery {name!r} holds {info.model} embeddings (dim {info.dim}); the server runs "
            f"{service.spec.name} (dim {service.spec.embedding_dim})",
            detail={"gallery_model": info.model, "gallery_dim": info.dim, "model": service.spec.name},
        )
    return info


def _parse_meta(meta: str | None) -> dict[str, Any] | None:
    if meta is None or meta == "":
        return None
    try:
        value = json.loads(meta)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"meta is not valid JSON: {exc.msg}", detail={"field": "meta"}) from None
    if not isinstance(value, dict):
        raise InvalidParameterError("meta must be a JSON object", detail={"field": "meta"})
    return value


@router.post(
    "/api/galleries/{name}/subjects/{subject_id}",
    response_model=EnrolResponse,
    responses={**_IMAGE_ERRORS, **_GALLERY_ERRORS},
    tags=["galleries"],
)
async def enrol(
    request: Request,
    name: str,
    subject_id: Annotated[str, Path(description="the caller's id for this person")],
    images: Annotated[list[UploadFile], File(description="1..max_images_per_request photos of the subject")],
    meta: Annotated[str | None, Form(description="JSON object stored with the subject")] = None,
) -> EnrolResponse:
    """Enrol (or add images to) a subject. Faces below the quality gate are refused and listed
    (unless ``enrol_requires_quality`` is off); 422 ``low_quality`` when no image passes."""
    from facegate.gallery.base import validate_subject_id

    state = _state(request)
    service, gallery = state.require_ready()
    validate_subject_id(subject_id)
    meta_obj = _parse_meta(meta)
    _check_count(len(images), state.settings.max_images_per_request, "images")
    await _gallery_for_service(state, name)

    async def one(i: int) -> Face:
        return (await faces_of_upload(state, service, images[i], index=i))[0]

    results = await gather_all([one(i) for i in range(len(images))])
    accepted: list[Face] = []
    refused: list[RefusedImage] = []
    errors: list[FacegateError] = []
    for i, r in enumerate(results):
        if isinstance(r, FacegateError):
            errors.append(r)
            refused.append(RefusedImage(index=i, reason=r.message, code=r.code))
        elif isinstance(r, BaseException):
            raise r
        elif state.settings.enrol_requires_quality and not r.quality.accepted:
            refused.append(RefusedImage(index=i, reason=_refusal_reason(r), code=QualityRejectedError.code))
            _record_refusal(state, "enrol_low_quality")
        else:
            accepted.append(r)
    if not accepted:
        detail = {"refused": [x.model_dump() for x in refused]}
        if any(x.code == QualityRejectedError.code for x in refused) or not errors:
            raise QualityRejectedError(
                f"no image of {subject_id!r} has a face that passes the quality gate; retake", detail=detail
            )
        err = errors[0]
        err.detail = {**err.detail, **detail}
        raise err
    emb = np.stack([f.embedding for f in accepted]).astype(np.float32)
    qual = np.asarray([f.quality.score for f in accepted], dtype=np.float32)
    info = await state.in_gallery_pool(gallery.enrol, name, subject_id, emb, qual, meta_obj)
    return EnrolResponse(subject=_subject_out(info), accepted=len(accepted), refused=refused)


@router.get(
    "/api/galleries/{name}/subjects",
    response_model=SubjectListResponse,
    responses=_GALLERY_ERRORS,
    tags=["galleries"],
)
async def list_subjects(
    request: Request,
    name: str,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> SubjectListResponse:
    """A page of subjects (ordered by id) and the gallery's total."""
    state = _state(request)
    _, gallery = state.require_ready()
    info = await state.in_gallery_pool(gallery.get_gallery, name)
    subjects = await state.in_gallery_pool(gallery.list_subjects, name, offset, limit)
    return SubjectListResponse(subjects=[_subject_out(s) for s in subjects], total=info.subjects)


@router.delete(
    "/api/galleries/{name}/subjects/{subject_id}",
    response_model=DeletedSubject,
    responses=_GALLERY_ERRORS,
    tags=["galleries"],
)
async def delete_subject(request: Request, name: str, subject_id: str) -> DeletedSubject:
    """Erase a subject and all its embeddings."""
    state = _state(request)
    _, gallery = state.require_ready()
    await state.in_gallery_pool(gallery.delete_subject, name, subject_id)
    return DeletedSubject(deleted=subject_id)


@router.post(
    "/api/galleries/{name}/search",
    response_model=SearchResponse,
    response_model_exclude_unset=True,
    responses={**_IMAGE_ERRORS, **_GALLERY_ERRORS},
    tags=["galleries"],
)
async def search(
    request: Request,
    name: str,
    image: Annotated[UploadFile, File(description="the probe photo")],
    k: Annotated[int, Query(ge=1, le=100, description="how many candidates")] = 5,
) -> SearchResponse:
    """1:N search with the largest face. A probe below the quality gate is refused, never searched."""
    state = _state(request)
    service, gallery = state.require_ready()
    await _gallery_for_service(state, name)
    face = (await faces_of_upload(state, service, image))[0]
    threshold, fmr = service.match_threshold, service.match_fmr
    if not face.quality.accepted:
        _record_refusal(state, "search_low_quality")
        return SearchResponse(
            face=FaceOut.from_face(face),
            refused=True,
            reason=_refusal_reason(face),
            hits=[],
            threshold=threshold,
            fmr=fmr,
        )
    queries = np.asarray(face.embedding, dtype=np.float32)[None]
    hits = (await state.in_gallery_pool(gallery.search, name, queries, k, threshold))[0]
    return SearchResponse(
        face=FaceOut.from_face(face),
        refused=False,
        reason=None,
        hits=[SearchHit(**h.to_dict()) for h in hits],
        threshold=threshold,
        fmr=fmr,
    )


def install_routes(app: FastAPI) -> None:
    """Add every route to ``app``, and the page's assets under ``/static``."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")
