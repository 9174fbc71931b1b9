"""A seed-style *naive* face service: the baseline facegate's serving is measured against.

What makes it naive (on purpose, as the seeds served): plain FastAPI on uvicorn with one worker, **sync**
``def`` endpoints (FastAPI runs them on its thread pool), **one image per model call** (no batching, not
even across the images of one request), **FP32** eager models, **synchronous** decode inside the request
thread, and the same :class:`facegate.pipeline.pipeline.FacePipeline` (real weights) called directly per
request. There is no queue, no engine and no CUDA graph.

What it shares with facegate, so that only the serving differs: the routes and JSON shapes of
``POST /api/compare`` (multipart ``img1``, ``img2``) and ``POST /api/embed`` (multipart ``images``, form
``aligned``, ``select``), built with facegate's own response models and error envelope; the image decoder
(with its limits); the pipeline (detector, alignment, recognizer, quality gate); ``GET /readyz``.

The models are loaded and warmed before uvicorn starts accepting connections, so ``/readyz`` answering
at all means ready (the harness measures the cold start up to that point).

    python benchmarks/peers/naive_server.py --port 8001 --device cuda
"""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, File, Form, Query, UploadFile
from fastapi.responses import JSONResponse, Response

from facegate.api.errors import facegate_error_response
from facegate.api.schemas import CompareResponse, EmbedItem, EmbedResponse, ErrorInfo, FaceOut
from facegate.config import Settings
from facegate.errors import EmptyInputError, FacegateError, ImageTooLargeError, InvalidParameterError
from facegate.io.decode import decode_image
from facegate.pipeline.pipeline import FacePipeline
from facegate.tuning import make_plan
from facegate.types import Face, FaceSelect

log = logging.getLogger("naive_server")


class NaiveService:
    """The pipeline plus the settings it was built from.

    ``serialize``: every model call runs on one dedicated thread, one at a time (warm-up included), instead
    of on whichever of FastAPI's up to 40 pool threads took the request. On the H200 the unserialised
    naive server (and a lock-only variant, still on many threads) answered no compare request within
    60 s at concurrency 100, while its GPU memory grew from 796 to 5,066 MiB: per-thread CUDA library
    state is the suspect (not verified).
    """

    def __init__(self, settings: Settings, *, serialize: bool = False) -> None:
        self.settings = settings
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="naive-model") if serialize else None
        self.pipeline = self._call(FacePipeline.from_settings, settings)
        self._call(self.pipeline.warmup)

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        if self.model_thread is None:
            return fn(*args, **kw)
        return self.model_thread.submit(fn, *args, **kw).result()

    def read(self, file: UploadFile) -> np.ndarray:
        """Read and decode one upload synchronously → ``(H, W, 3) uint8`` RGB."""
        s = self.settings.limits
        data = file.file.read(s.max_upload_bytes + 1)
        if len(data) > s.max_upload_bytes:
            raise ImageTooLargeError(f"upload exceeds the limit of {s.max_upload_bytes} bytes")
        if not data:
            raise EmptyInputError("the uploaded file is empty (0 bytes)")
        return decode_image(data, max_bytes=s.max_upload_bytes, max_pixels=s.max_pixels)

    def faces(
        self, image: np.ndarray, select: FaceSelect = FaceSelect.LARGEST, *, keep_crops: bool = False
    ) -> list[Face]:
        """One image through the whole pipeline (a batch of one); raises NoFaceError."""
        return self._call(self.pipeline.faces, [image], select=select, keep_crops=keep_crops)[0]


def create_naive_app(settings: Settings, *, serialize: bool = False) -> FastAPI:
    """The naive app; the pipeline is built and warmed in the lifespan (before the port accepts)."""
    holder: dict[str, NaiveService] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        holder["svc"] = NaiveService(settings, serialize=serialize)  # blocks startup: naive on purpose
        log.info("naive service ready (device=%s, fp32, no batching)", make_plan(settings).device)
        yield

    app = FastAPI(title="naive face service", lifespan=lifespan)

    @app.exception_handler(FacegateError)
    def _facegate_error(_: Any, exc: FacegateError) -> JSONResponse:
        return facegate_error_response(exc)

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        return {"status": "ready", "model": holder["svc"].pipeline.spec.name, "device": make_plan(settings).device}

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/compare", response_model=CompareResponse, response_model_exclude_unset=True)
    def compare(
        img1: Annotated[UploadFile, File()],
        img2: Annotated[UploadFile, File()],
        crops: Annotated[bool, Query()] = False,
    ) -> CompareResponse:
        svc = holder["svc"]
        a = svc.faces(svc.read(img1), keep_crops=crops)[0]
        b = svc.faces(svc.read(img2), keep_crops=crops)[0]
        res = svc.pipeline.compare_faces(a, b)
        return CompareResponse.from_result(res, model=svc.pipeline.spec.name, crops=crops)

    @app.post("/api/embed", response_model=EmbedResponse, response_model_exclude_unset=True)
    def embed(
        images: Annotated[list[UploadFile], File()],
        select: Annotated[str, Form()] = "largest",
        aligned: Annotated[bool, Form()] = False,
    ) -> EmbedResponse | Response:
        svc = holder["svc"]
        if not 1 <= len(images) <= settings.limits.max_images_per_request:
            raise InvalidParameterError(f"give 1..{settings.limits.max_images_per_request} images")
        if select not in ("largest", "all"):
            raise InvalidParameterError("select must be 'largest' or 'all'")
        items: list[EmbedItem] = []
        for i, f in enumerate(images):  # one image at a time, no batching
            try:
                image = svc.read(f)
                if aligned and image.shape != (112, 112, 3):
                    raise InvalidParameterError(f"an aligned crop must be 112×112×3, got {image.shape}")
                faces = svc.faces(image, FaceSelect(select))
                items.append(EmbedItem(index=i, faces=[FaceOut.from_face(x, embedding=True) for x in faces]))
            except FacegateError as exc:
                items.append(EmbedItem(index=i, error=ErrorInfo(**exc.to_dict())))
        return EmbedResponse(model=svc.pipeline.spec.name, dim=svc.pipeline.spec.embedding_dim, results=items)

    return app


def main(argv: list[str] | None = None) -> None:
    """Parse flags and serve with uvicorn (one worker) until SIGINT/SIGTERM."""
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--serialize",
        action="store_true",
        help="every model call on one dedicated thread, one at a time (default: FastAPI's thread pool)",
    )
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(device=a.device, precision="fp32", compile="off", engine={"max_batch_size": 1})
    app = create_naive_app(settings, serialize=a.serialize)
    uvicorn.run(app, host=a.host, port=a.port, workers=1, log_level=a.log_level, access_log=False)


if __name__ == "__main__":
    main()
