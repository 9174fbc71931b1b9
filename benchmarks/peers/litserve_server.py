"""LitServe serving facegate's pipeline with LitServe's own dynamic batching (the "LitServe" peer).

Two :class:`litserve.LitAPI` instances, one per route, in one :class:`litserve.LitServer`:

* ``POST /api/compare`` (multipart ``img1``, ``img2``) → facegate's compare JSON;
* ``POST /api/embed`` (multipart ``images`` (1..64), form ``aligned``, ``select``) → facegate's embed JSON.

Both use ``max_batch_size=64`` and ``batch_timeout`` (default 3 ms): LitServe collects up to 64 *requests*
into one ``predict`` call. ``predict`` then runs the same :class:`~facegate.pipeline.pipeline.FacePipeline`
(real weights) on the whole batch: one batched detection over every photo of the batch, one alignment
call, one batched embedding over every crop. Responses are built with facegate's own response models,
so the JSON shapes and the error envelope/statuses match facegate's.

How LitServe works here (read from litserve 0.2.19's source, ``server.py`` and ``loops/simple_loops.py``):

* LitServe starts one *inference worker process* per LitAPI per device (``workers_per_device=1``), so the
  two routes run in two processes, each holding its own copy of the models (on a GPU: two CUDA contexts).
  By default it also starts one uvicorn *API-server process* per inference worker (``num_api_servers``
  None → 2 here); ``--api-servers`` overrides that.
* ``decode_request`` receives the request's parsed form: a ``starlette.datastructures.FormData`` whose
  file fields are ``UploadFile`` objects. The API server pickles that form into the worker's queue, so
  ``decode_request`` runs in the inference worker, synchronously, one request after the other, before the
  batch is formed (LitServe's design: decode is not overlapped with compute). Uploads above 1 MiB are
  spooled to disk by Starlette and cannot be pickled: fine for LFW photos (≈15 KB) and crops.
* An exception raised anywhere in the batched loop fails *every* request of the batch; so per-request
  errors (no face, unreadable image) are carried as values through ``predict`` and turned into facegate's
  JSON error response (same status codes) in ``encode_response``.
* LitServe adds ``GZipMiddleware`` (responses ≥ 1000 bytes are gzipped when the client accepts gzip, as
  httpx does): embed answers are compressed, facegate's are not. That is LitServe's default; kept.
* ``/readyz`` is LitServe's health route (renamed from ``/health``): 200 ``ok`` once every worker finished
  ``setup`` (models loaded and warmed), 503 before. It answers plain text, not facegate's JSON.

What does not match facegate: ``/api/compare?crops=true`` is ignored (LitServe hands ``decode_request``
the form only, not the query string), ``paths`` (server-side files) is not supported, a request-timeout
answers LitServe's own 504 body. The benchmark uses none of these.

    python benchmarks/peers/litserve_server.py --port 8002 --device cuda --precision fp16
"""

import argparse
import logging
from typing import Any

import litserve as ls
import numpy as np
from fastapi.responses import JSONResponse, Response

from facegate.api.errors import facegate_error_response
from facegate.api.schemas import CompareResponse, EmbedItem, EmbedResponse, ErrorInfo, FaceOut
from facegate.config import Settings
from facegate.errors import EmptyInputError, FacegateError, ImageTooLargeError, InvalidParameterError
from facegate.io.decode import decode_image
from facegate.pipeline.align import is_aligned_crop
from facegate.pipeline.pipeline import FacePipeline, select_faces
from facegate.types import Detection, Face, FaceSelect

log = logging.getLogger("litserve_server")

#: What ``predict`` hands ``encode_response``: a JSON body, or the error to answer with.
Outcome = dict[str, Any] | FacegateError


def _read_upload(upload: Any, settings: Settings) -> np.ndarray:
    """A Starlette ``UploadFile`` from the form → ``(H, W, 3) uint8`` RGB (raises FacegateError)."""
    if upload is None or not hasattr(upload, "file"):
        raise InvalidParameterError("expected a file upload")
    data = upload.file.read(settings.limits.max_upload_bytes + 1)
    if len(data) > settings.limits.max_upload_bytes:
        raise ImageTooLargeError(f"upload exceeds the limit of {settings.limits.max_upload_bytes} bytes")
    if not data:
        raise EmptyInputError("the uploaded file is empty (0 bytes)")
    return decode_image(data, max_bytes=settings.limits.max_upload_bytes, max_pixels=settings.limits.max_pixels)


class _PipelineAPI(ls.LitAPI):
    """Shared set-up: build and warm the pipeline on LitServe's device for this worker."""

    def __init__(self, settings_kw: dict[str, Any], **kw: Any) -> None:
        super().__init__(**kw)
        self.settings_kw = settings_kw
        self.settings: Settings | None = None
        self.pipeline: FacePipeline | None = None

    def setup(self, device: str) -> None:
        """``device``: LitServe's identifier, ``"cpu"`` or ``"cuda:N"``."""
        if str(device).startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(device))
            dev = "cuda"
        else:
            dev = "cpu"
        self.settings = Settings(**{**self.settings_kw, "device": dev})
        self.pipeline = FacePipeline.from_settings(self.settings)
        self.pipeline.warmup()
        log.info("%s ready on %s", type(self).__name__, device)

    # ---------------------------------------------------------------- shared batched stages
    def _faces_of_photos(self, images: list[np.ndarray]) -> list[Face | FacegateError]:
        """Largest face of each photo: one batched detection, one align call, one batched embedding."""
        p = self.pipeline
        assert p is not None
        out: list[Face | FacegateError] = [InvalidParameterError("unset")] * len(images)
        if not images:
            return out
        dets = p.detect(images)
        chosen: list[Detection] = []
        owners: list[int] = []
        for i, ds in enumerate(dets):
            try:
                chosen.append(select_faces(ds, FaceSelect.LARGEST)[0])
                owners.append(i)
            except FacegateError as exc:
                out[i] = exc
        crops = p.align(images, chosen, owners)
        emb, q, raw = p.embed(crops)
        for face, i in zip(p.make_faces(chosen, crops, emb, q, raw), owners, strict=True):
            out[i] = face
        return out

    def encode_response(self, output: Outcome) -> Response:
        """A body → 200 JSON; a FacegateError → facegate's error JSON with its status."""
        if isinstance(output, FacegateError):
            return facegate_error_response(output)
        return JSONResponse(output)


class CompareAPI(_PipelineAPI):
    """``POST /api/compare``: the largest face of ``img1`` and of ``img2``, compared with the quality gate."""

    def decode_request(self, request):  # no annotation: LitServe routes by it
        """``request``: the form (``FormData``) → the two decoded photos, or the error to answer with."""
        assert self.settings is not None
        try:
            return _read_upload(request.get("img1"), self.settings), _read_upload(request.get("img2"), self.settings)
        except FacegateError as exc:
            return exc

    def predict(self, batch: list[tuple[np.ndarray, np.ndarray] | FacegateError]) -> list[Outcome]:
        assert self.pipeline is not None
        ok = [i for i, x in enumerate(batch) if not isinstance(x, FacegateError)]
        photos = [img for i in ok for img in batch[i]]  # type: ignore[union-attr]
        faces = self._faces_of_photos(photos)
        out: list[Outcome] = [x if isinstance(x, FacegateError) else {} for x in batch]  # type: ignore[misc]
        for k, i in enumerate(ok):
            a, b = faces[2 * k], faces[2 * k + 1]
            if isinstance(a, FacegateError):
                out[i] = a
            elif isinstance(b, FacegateError):
                out[i] = b
            else:
                res = self.pipeline.compare_faces(a, b)
                body = CompareResponse.from_result(res, model=self.pipeline.spec.name)
                out[i] = body.model_dump(mode="json", exclude_unset=True)
        return out


class EmbedAPI(_PipelineAPI):
    """``POST /api/embed``: photos (detect → largest/all faces) or aligned 112×112 crops (``aligned=true``)."""

    def decode_request(self, request):  # no annotation: LitServe routes by it
        """``request``: the form (``FormData``) → ``{"items": [image | error], "select": str}`` or an error."""
        assert self.settings is not None
        uploads = list(request.getlist("images")) if hasattr(request, "getlist") else []
        aligned = str(request.get("aligned", "false")).lower() in ("1", "true", "yes", "on")
        select = str(request.get("select", "largest"))
        if not uploads:
            return EmptyInputError("no images given", detail={"field": "images"})
        if len(uploads) > self.settings.limits.max_images_per_request:
            return InvalidParameterError(f"more than {self.settings.limits.max_images_per_request} images")
        if select not in ("largest", "all"):
            return InvalidParameterError("select must be 'largest' or 'all'", detail={"field": "select"})
        items: list[np.ndarray | FacegateError] = []
        for u in uploads:
            try:
                img = _read_upload(u, self.settings)
                if aligned and not is_aligned_crop(img):
                    raise InvalidParameterError(f"an aligned crop must be 112×112×3 uint8, got {img.shape}")
                items.append(img)
            except FacegateError as exc:
                items.append(exc)
        return {"items": items, "select": select}

    def predict(self, batch: list[dict[str, Any] | FacegateError]) -> list[Outcome]:
        p = self.pipeline
        assert p is not None
        # every image of every request: 112×112 crops go straight to the embedding, photos are detected first
        refs: list[tuple[int, int]] = []  # (request, item) of each photo
        photos: list[np.ndarray] = []
        results: dict[tuple[int, int], list[Face] | FacegateError] = {}
        crop_list: list[np.ndarray] = []
        crop_owner: list[tuple[int, int]] = []
        crop_det: list[Detection | None] = []
        for r, req in enumerate(batch):
            if isinstance(req, FacegateError):
                continue
            for j, item in enumerate(req["items"]):
                if isinstance(item, FacegateError):
                    results[(r, j)] = item
                elif is_aligned_crop(item):
                    crop_list.append(np.ascontiguousarray(item)[None])
                    crop_owner.append((r, j))
                    crop_det.append(None)
                else:
                    refs.append((r, j))
                    photos.append(item)
        if photos:
            for (r, j), img_i, ds in zip(refs, range(len(photos)), p.detect(photos), strict=True):
                try:
                    sel = select_faces(ds, FaceSelect(batch[r]["select"]))  # type: ignore[index]
                except FacegateError as exc:
                    results[(r, j)] = exc
                    continue
                crop_list.append(p.align(photos, sel, [img_i] * len(sel)))
                crop_owner.extend([(r, j)] * len(sel))
                crop_det.extend(sel)
        if crop_list:
            crops = np.concatenate(crop_list)
            emb, q, raw = p.embed(crops)
            for face, key in zip(p.make_faces(crop_det, crops, emb, q, raw), crop_owner, strict=True):
                got = results.setdefault(key, [])
                assert isinstance(got, list)
                got.append(face)
        out: list[Outcome] = []
        for r, req in enumerate(batch):
            if isinstance(req, FacegateError):
                out.append(req)
                continue
            items: list[EmbedItem] = []
            for j in range(len(req["items"])):
                res = results[(r, j)]
                if isinstance(res, FacegateError):
                    items.append(EmbedItem(index=j, error=ErrorInfo(**res.to_dict())))
                else:
                    items.append(EmbedItem(index=j, faces=[FaceOut.from_face(f, embedding=True) for f in res]))
            body = EmbedResponse(model=p.spec.name, dim=p.spec.embedding_dim, results=items)
            out.append(body.model_dump(mode="json", exclude_unset=True))
        return out


def build_server(
    *,
    device: str,
    precision: str,
    compile_mode: str = "off",
    max_batch_size: int = 64,
    batch_timeout_s: float = 0.003,
    fast_queue: bool = False,
    timeout_s: float = 60.0,
) -> ls.LitServer:
    """The LitServer with both routes; ``device`` ``"cpu"`` or ``"cuda"`` (one worker per route per device)."""
    kw: dict[str, Any] = {"precision": precision, "compile": compile_mode, "max_batch_size": max(64, max_batch_size)}
    apis = [
        CompareAPI(kw, max_batch_size=max_batch_size, batch_timeout=batch_timeout_s, api_path="/api/compare"),
        EmbedAPI(kw, max_batch_size=max_batch_size, batch_timeout=batch_timeout_s, api_path="/api/embed"),
    ]
    return ls.LitServer(
        apis,
        accelerator="cuda" if device == "cuda" else "cpu",
        devices=1,
        workers_per_device=1,
        timeout=timeout_s,
        healthcheck_path="/readyz",
        fast_queue=fast_queue,
    )


def main(argv: list[str] | None = None) -> None:
    """Parse flags and serve until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1", "0.0.0.0"])
    p.add_argument("--port", type=int, default=8002)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--compile", dest="compile_mode", default="off", choices=["off", "graphs", "inductor"])
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--batch-timeout-ms", type=float, default=3.0)
    p.add_argument("--fast-queue", action="store_true", help="LitServe's ZMQ transport instead of mp queues")
    p.add_argument("--api-servers", type=int, default=None, help="uvicorn processes (LitServe default: one per worker)")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(
        device=a.device,
        precision=a.precision,
        compile_mode=a.compile_mode,
        max_batch_size=a.max_batch_size,
        batch_timeout_s=a.batch_timeout_ms / 1000.0,
        fast_queue=a.fast_queue,
    )
    server.run(
        host=a.host,
        port=a.port,
        num_api_servers=a.api_servers,
        generate_client_file=False,
        log_level=a.log_level,
        access_log=False,
    )


if __name__ == "__main__":
    main()
