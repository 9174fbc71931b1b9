"""The async face service: the pipeline's stages behind the engine, which batches across concurrent requests;
the alignment of one request's few faces runs inline."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

import numpy as np

from facegate.config import Settings
from facegate.engine.engine import DeviceThread, Engine
from facegate.errors import InvalidParameterError
from facegate.metrics.stats import ServiceStats, torch_cuda_memory_fn
from facegate.models.registry import ModelSpec, get_spec
from facegate.pipeline.align import is_aligned_crop
from facegate.pipeline.pipeline import FacePipeline, Operating, configure_cpu_threads, select_faces, within_memory_limit
from facegate.pipeline.search import PhotoSearchStage, SearchStage, encode_photo_search, encode_search
from facegate.transport.remote import RemoteEngine, RemotePool
from facegate.tuning import ServingPlan, make_plan
from facegate.types import CompareResult, Detection, Face, FaceSelect

log = logging.getLogger(__name__)


class FaceService:
    """Async façade over one :class:`FacePipeline` and one :class:`Engine` (one per device)."""

    def __init__(
        self,
        pipeline: FacePipeline,
        settings: Settings,
        stats: ServiceStats | None = None,
        *,
        engine: RemoteEngine | RemotePool | None = None,
        device_thread: DeviceThread | None = None,
        search_stage: Any = None,
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.stats = stats or ServiceStats()
        #: the engine's gallery search stage (:mod:`facegate.pipeline.search`), when this process owns the engine
        self.search_stage = search_stage
        if pipeline.device_name.startswith("cuda"):
            self.stats.gpu_memory_fn = torch_cuda_memory_fn(pipeline.device)
        #: the local engine, or the connection to the engine process (then ``pipeline`` holds no models)
        stages = pipeline.stages() if engine is None else []
        if search_stage is not None:
            stages.append(search_stage)
            photo = next((st for st in stages if st.name == "photo"), None)
            if photo is not None:
                stages.append(PhotoSearchStage(photo, search_stage))
        self.engine: Engine | RemoteEngine | RemotePool = engine or Engine(
            stages,
            max_batch_size=settings.engine.max_batch_size,
            max_wait_ms=settings.engine.max_wait_ms,
            max_queue=settings.limits.max_queue,
            request_timeout_s=settings.limits.request_timeout_s,
            stats=self.stats,
            device_thread=device_thread,
        )
        self._ready = False
        #: whether the engine has the ``photo`` stage (ServingPlan.photo_stage): see :meth:`photo_faces`
        self.photo_on_device = pipeline.photo_limits is not None

    @classmethod
    def build(cls, settings: Settings, plan: ServingPlan | None = None) -> FaceService:
        """Real models, as the settings and the serving plan describe. They load on the engine's device thread, so
        the build's probing forwards take no library handles on another thread."""
        t0 = time.perf_counter()
        plan = plan or make_plan(settings)
        device_thread = DeviceThread(plan.cpu_shards)
        with within_memory_limit(settings.engine.gpu_memory_limit_mib, "load the models"):
            pipeline = device_thread.submit(FacePipeline.from_settings, settings, plan).result()
        t1 = time.perf_counter()
        stats = ServiceStats()
        hooks = {"stats_hook": stats.gallery_sizes_hook(), "lag_hook": stats.gallery_feed_lag.observe}
        search = SearchStage.from_settings(
            settings, pipeline.device_name, (pipeline.spec.name, pipeline.spec.embedding_dim), **hooks
        )
        service = cls(pipeline, settings, stats, device_thread=device_thread, search_stage=search)
        log.info("built the pipeline in %.2f s and the engine in %.2f s", t1 - t0, time.perf_counter() - t1)
        return service

    @classmethod
    def connect(
        cls, settings: Settings, address: str | list[str], authkey: bytes, plan: ServingPlan | None = None
    ) -> FaceService:
        """A front-end's service over the engine process(es) at ``address`` (several: a
        :class:`~facegate.transport.remote.RemotePool`); blocking connect."""
        engines = [RemoteEngine(a, authkey) for a in ([address] if isinstance(address, str) else address)]
        remote = engines[0] if len(engines) == 1 else RemotePool(engines)
        remote.start()
        return cls.over_engine(settings, remote, plan)

    @classmethod
    def over_engine(cls, settings: Settings, remote: Any, plan: ServingPlan | None = None) -> FaceService:
        """A front-end's service over a started engine client (anything with ``info``, ``ready``, ``submit``,
        ``stop``); the model spec and thresholds come from its info, so front-ends gate as the engine would."""
        info = remote.info
        # decoding and alignment run here: the same thread setting as the engine's process
        configure_cpu_threads((plan or make_plan(settings)).cpu_threads)
        operating = Operating(**info["operating"])
        pipeline = FacePipeline(
            get_spec(info["model"]), None, None, device="cpu", operating=operating, quality=settings.quality
        )
        service = cls(pipeline, settings, engine=remote)
        service.photo_on_device = "photo" in info.get("stages", ())
        return service

    @property
    def spec(self) -> ModelSpec:
        return self.pipeline.spec

    @property
    def ready(self) -> bool:
        return self._ready and self.engine.ready

    async def start(self) -> None:
        """Warm the models (off the event loop), then start the engine."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        if isinstance(self.engine, Engine):  # a remote engine warmed its own models
            # on the device thread: its library handles then serve the batches too
            with within_memory_limit(self.settings.engine.gpu_memory_limit_mib, "warm the models up"):
                await loop.run_in_executor(self.engine.device_executor, self.pipeline.warmup)
            self.photo_on_device = self.pipeline.photo_limits is not None  # warm-up confirms the stage
        await loop.run_in_executor(None, self.engine.start)
        # full collections would otherwise walk the ~200k start-up objects with the GIL held
        gc.collect()
        gc.freeze()
        log.info("froze %d start-up objects out of the garbage collector's reach", gc.get_freeze_count())
        self._ready = True
        log.info("face service ready in %.2f s", time.perf_counter() - t0)

    async def stop(self) -> None:
        self._ready = False
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
        if self.search_stage is not None:
            self.search_stage.close()

    async def photo_search(self, data: bytes, gallery: str, k: int) -> tuple[list[Face], Any]:
        """The largest face of one encoded photo and its top-``k`` in ``gallery``, in one engine trip
        (the engine's ``photo_search`` stage; only when :attr:`photo_on_device`)."""
        res, out = await self._submit("photo_search", encode_photo_search(gallery, data, k))
        faces = self.pipeline.make_faces(res.detections, None, res.embedding, res.quality, res.raw, stats=res.stats)
        return self._record(faces), out

    async def search(self, gallery: str, query: np.ndarray, k: int) -> Any:
        """Top-``k`` of one ``(D,) float32`` embedding in ``gallery``, on the engine's index: a
        :class:`~facegate.pipeline.search.SearchOut` (current with every write acknowledged before the call)."""
        return await self._submit("search", encode_search(gallery, query, k))

    async def _submit(self, stage: str, payload: np.ndarray) -> Any:
        """``engine.submit``, timed into ``facegate_engine_call_seconds{stage}`` (answers and errors alike)."""
        t0 = time.perf_counter()
        try:
            return await self.engine.submit(stage, payload)
        finally:
            self.stats.engine_call.labels(stage).observe(time.perf_counter() - t0)

    async def detect(self, image: np.ndarray) -> list[Detection]:
        """Detections of one ``(H,W,3) uint8`` RGB image, sorted by score (may be empty)."""
        return await self._submit("detect", image)

    def _record(self, faces: list[Face]) -> list[Face]:
        for f in faces:
            self.stats.quality_score.observe(f.quality.score)
            if not f.quality.accepted:
                self.stats.refusals.labels("low_quality").inc()
        return faces

    async def faces(
        self,
        image: np.ndarray,
        *,
        select: FaceSelect | str = FaceSelect.LARGEST,
        keep_crops: bool = False,
    ) -> list[Face]:
        """Detect, select, align, embed and gate the faces of one image, whatever its size (only the caller knows
        that an upload is an aligned crop: :meth:`face_aligned`). Raises :class:`NoFaceError` when none is found."""
        chosen = select_faces(await self.detect(image), select)
        crops = self.pipeline.align([image], chosen, [0] * len(chosen))
        emb, q, raw = await self._submit("embed", crops)
        return self._record(self.pipeline.make_faces(chosen, crops, emb, q, raw, keep_crops=keep_crops))

    async def photo_faces(self, data: bytes) -> list[Face]:
        """:meth:`faces` (largest face, no crops) of one *encoded* photo in one engine trip: the ``photo`` stage
        decodes, detects, aligns and embeds on the device (only when :attr:`photo_on_device`). Raises the upload's
        ImageDecodeError, ImageTooLargeError, ..., or NoFaceError."""
        res = await self._submit("photo", np.frombuffer(data, np.uint8))
        return self._record(
            self.pipeline.make_faces(res.detections, None, res.embedding, res.quality, res.raw, stats=res.stats)
        )

    async def face_aligned(self, crop: np.ndarray) -> Face:
        """Embed and gate one pre-aligned ``(112,112,3) uint8`` RGB crop (no detection)."""
        if not is_aligned_crop(crop) or crop.dtype != np.uint8:  # here: in a batch it would fail the others' crops
            raise InvalidParameterError(f"an aligned crop must be 112×112×3 uint8, got {crop.shape} {crop.dtype}")
        crops = np.ascontiguousarray(crop)[None]
        emb, q, raw = await self._submit("embed", crops)
        return self._record(self.pipeline.make_faces([None], crops, emb, q, raw))[0]

    def compare(self, a: Face, b: Face) -> CompareResult:
        """1:1 compare with the quality gate (refused pairs are never compared)."""
        res = self.pipeline.compare_faces(a, b)
        if res.refused:
            self.stats.refusals.labels("compare_low_quality").inc()
        return res
