"""The face pipeline on batches of ``(H, W, 3) uint8`` RGB images: detect → select → align → embed + quality → gate."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from facegate.config import QualitySettings, Settings
from facegate.errors import InvalidParameterError
from facegate.models.registry import ModelSpec, get_spec
from facegate.pipeline.align import align_cpu
from facegate.pipeline.base import select_faces
from facegate.pipeline.results import EmbedOut
from facegate.quality_reasons import (
    crop_stats,
    enrol_gate,
    enrol_verdict,
    face_reasons,
    load_reliability,
    quality_verdict,
    reliability,
)
from facegate.tuning import ServingPlan, make_plan
from facegate.types import CompareResult, Detection, Face, QualityVerdict

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def configure_cpu_threads(threads: int | None) -> None:
    """Set OpenCV's and, if loaded (never imported here), torch's intra-op threads; None: defaults."""
    if threads is not None:
        import cv2

        cv2.setNumThreads(threads)
        torch_mod = sys.modules.get("torch")
        if torch_mod is not None:
            torch_mod.set_num_threads(threads)
        log.info("intra-op threads of %s: %d", "torch and OpenCV" if torch_mod is not None else "OpenCV", threads)


#: No cuBLAS / cuBLASLt workspaces: PyTorch otherwise keeps one per thread and stream that ran a GEMM (tens of
#: MiB of GPU memory each), and the models' only GEMMs are their small embedding heads.
NO_GEMM_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def configure_device(plan: ServingPlan, mib: int | None = None) -> None:
    """Set this engine process up for ``plan.device`` before its models load; call before the first ``import torch``.

    On CUDA, :data:`NO_GEMM_WORKSPACE` unless the user set them; the allocator capped at ``mib`` MiB
    (``engine.gpu_memory_limit_mib``; more than the device has: InvalidParameterError); one free
    ``plan.gpu_arena_mib`` MiB segment left in PyTorch's caching allocator, for the weights and activations to share.
    Then :func:`configure_cpu_threads`.
    """
    if plan.device == "cuda":
        for key, value in NO_GEMM_WORKSPACE.items():
            os.environ.setdefault(key, value)
    import torch

    configure_cpu_threads(plan.cpu_threads)
    if plan.device != "cuda":
        return
    try:
        dev = torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # torch built without CUDA, or no GPU (driver) here
        raise InvalidParameterError("--device cuda but no CUDA device is available") from None
    if mib is not None:
        total = torch.cuda.get_device_properties(dev).total_memory
        if mib * 2**20 > total:
            raise InvalidParameterError(
                f"gpu_memory_limit_mib={mib} exceeds the device's {total / 2**20:.0f} MiB",
                detail={"limit_mib": mib, "device_mib": round(total / 2**20)},
            )
        fraction = mib * 2**20 / total
        torch.cuda.set_per_process_memory_fraction(fraction, dev)
        log.info(
            "GPU memory: the allocator of this process holds at most %d MiB (%.4f of device %d)", mib, fraction, dev
        )
    if plan.gpu_arena_mib is not None:
        # freed at once: back to the allocator's cache as one free block of the whole segment
        torch.empty(plan.gpu_arena_mib * 2**20, dtype=torch.uint8, device=dev)
        reserved = torch.cuda.memory_reserved(dev) / 2**20
        log.info(
            "GPU memory: a %d MiB arena on device %d (the allocator holds %.1f MiB)", plan.gpu_arena_mib, dev, reserved
        )


@contextlib.contextmanager
def within_memory_limit(limit_mib: int | None, what: str) -> Iterator[None]:
    """A CUDA out-of-memory error under ``engine.gpu_memory_limit_mib`` → InvalidParameterError naming the limit."""
    try:
        yield
    except Exception as exc:
        if limit_mib is None or type(exc).__name__ != "OutOfMemoryError":
            raise
        first = str(exc).split(". ", 2)
        raise InvalidParameterError(
            f"gpu_memory_limit_mib={limit_mib} is too small to {what}: {'. '.join(first[:2])}",
            detail={"limit_mib": limit_mib, "during": what},
        ) from exc


def start_photo_check() -> Callable[[], bool]:
    """:func:`~facegate.io.decode.gpu_decode_available` (seconds: it imports torchvision) on a thread; returns a
    function waiting for the answer."""
    from facegate.io import decode

    answer: list[bool] = []
    thread = threading.Thread(
        target=lambda: answer.append(decode.gpu_decode_available()), name="facegate-photo-check", daemon=True
    )
    thread.start()

    def wait() -> bool:
        thread.join()
        return bool(answer and answer[0])

    return wait


@dataclass(frozen=True, slots=True)
class Operating:
    """The operating point in force: the match threshold and the FMR it was calibrated to, and the quality gate."""

    match_threshold: float
    match_fmr: float
    quality_threshold: float


class FacePipeline:
    """Batched, synchronous face pipeline around one detector and one recognizer on one device."""

    def __init__(
        self,
        spec: ModelSpec,
        detector: Any,
        recognizer: torch.nn.Module,
        *,
        device: str,
        operating: Operating,
        quality: QualitySettings | None = None,
    ) -> None:
        self.spec = spec
        self.detector = detector
        self.recognizer = recognizer
        #: ``"cpu"`` / ``"cuda"``; :attr:`device` is the torch device
        self.device_name = str(device)
        self.operating = operating
        self.reason_limits = quality if quality is not None else QualitySettings()
        self.enrol_threshold = enrol_gate(operating.quality_threshold, self.reason_limits.enrol_gate)
        self.reliability_weights = load_reliability(spec.name)
        #: ServingPlan.cpu_chunk (largest sub-batch per forward; None = no split)
        self.chunk: int | None = None
        #: on the CPU, threads running the rows of one batch at once (ServingPlan.cpu_shards); None: in turn
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: float32 bytes of photos the photo stage warps at once; None = a whole batch
        self.photo_warp_bytes: int | None = None
        #: ``(max_bytes, max_pixels)`` of the ``photo`` stage; None = no stage
        self.photo_limits: tuple[int, int] | None = None
        self.det_warm_sizes: list[tuple[int, int]] = [(250, 250)]
        self.warmup_report: dict[str, dict[str, float]] = {}
        #: pending check that the ``photo`` stage can run (:func:`start_photo_check`); warmup() joins it
        self._photo_check: Callable[[], bool] | None = None
        self._photo_select_post: Any = None

    @functools.cached_property
    def device(self) -> torch.device:
        """The pipeline's torch device (imports torch: the engine side only)."""
        import torch

        return torch.device(self.device_name)

    @classmethod
    def from_settings(cls, settings: Settings, plan: ServingPlan | None = None) -> FacePipeline:
        """Build the pipeline the settings and the serving plan (:func:`facegate.tuning.make_plan`) describe."""
        plan = plan or make_plan(settings)
        configure_device(plan, settings.engine.gpu_memory_limit_mib)  # before the first import of torch here
        import torch

        from facegate.models.detector import FaceDetector
        from facegate.models.recognizer import build_recognizer, frozen_cpu
        from facegate.models.yunet import load_yunet
        from facegate.runtime.kernels import set_fused_epilogues

        device = plan.device
        if device == "cpu" and plan.precision == "fp16":
            raise InvalidParameterError("fp16 needs CUDA; use --precision fp32 or bf16 on CPU")
        spec = get_spec("irse64_rts" if settings.rts_checkpoint is not None else settings.model)
        det = settings.detector
        detector = FaceDetector(
            load_yunet(),
            device=device,
            # fp32 on every device: it is tiny, and fp16 landmarks move the alignment enough to cost embedding parity
            dtype=torch.float32,
            score_threshold=det.score_threshold,
            nms_threshold=det.nms_threshold,
            top_k=det.top_k,
            max_side=det.max_side,
            # NCHW on CUDA: cuDNN plans an NHWC convolution in seconds per new shape and thread, NCHW in ms, at
            # equal steady-state speed; NHWC on the CPU, where it is several times faster
            channels_last=plan.det_channels_last,
        )
        detector.max_batch_pixels = plan.det_max_batch_pixels  # largest forward in padded pixels (None: no cap)
        max_batch = settings.engine.max_batch_size
        buckets = sorted({b for b in plan.graph_buckets if b <= max_batch} | {max_batch})
        frozen = plan.compile == "torchscript" and plan.activation_budget_mib is None  # CPU only (make_plan)
        recognizer = build_recognizer(
            spec,
            checkpoint=settings.rts_checkpoint,
            quality_head=settings.quality_head,
            device=device,
            dtype="fp32" if frozen else plan.precision,  # frozen_cpu casts after folding BatchNorm in fp32
            channels_last=plan.channels_last and plan.precision != "fp32",
        )
        recognizer.flip_tta = settings.flip_tta
        if device == "cuda":  # batch-size buckets for the detector on the GPU (shapes planned at warm-up)
            detector.batch_buckets = tuple(buckets)
            set_fused_epilogues(detector.model, plan.fused_kernels)  # conv bias (+ ReLU), depthwise tail: one kernel
            recognizer.backbone.fuse()  # fold BatchNorm into convs: fewer kernels, same embeddings
            # bias + PReLU of each folded conv in one kernel (Inductor fuses these itself)
            set_fused_epilogues(recognizer.backbone, plan.fused_kernels and plan.compile != "inductor")
        elif plan.onnx_cpu:  # only ever set on the CPU (tuning.make_plan)
            from facegate.models.onnx_backend import attach_onnx_detector

            attach_onnx_detector(detector)
        recognizer.set_activation_budget(plan.activation_budget_mib)  # after fusing: it measures the layers that run
        if frozen:
            recognizer = frozen_cpu(recognizer, plan.precision)
        if device == "cuda" and plan.compile != "off":
            from facegate.runtime.graphs import INDUCTOR_SERVING_OPTIONS, GraphedModule

            if plan.det_graphs:
                detector.enable_graphs()
            recognizer = GraphedModule(
                recognizer,
                (*spec.input_size, 3),
                torch.uint8,
                buckets=buckets,
                compile_mode="max-autotune-no-cudagraphs" if plan.compile == "inductor" else None,
                compile_options=INDUCTOR_SERVING_OPTIONS if plan.compile == "inductor" else None,
            )
        match, quality = settings.match_threshold, settings.quality_threshold
        operating = Operating(
            match_threshold=spec.thresholds.match if match is None else match,
            match_fmr=spec.thresholds.match_fmr,
            quality_threshold=spec.thresholds.quality if quality is None else quality,
        )
        log.info(
            "pipeline: model=%s device=%s precision=%s match>=%.4f (FMR %.0e) quality>=%.3f",
            spec.name,
            device,
            plan.precision,
            operating.match_threshold,
            operating.match_fmr,
            operating.quality_threshold,
        )
        pipe = cls(spec, detector, recognizer, device=device, operating=operating, quality=settings.quality)
        pipe.photo_warp_bytes = plan.photo_warp_mib * 2**20
        pipe.det_warm_sizes = [tuple(sz) for sz in det.warm_sizes]  # type: ignore[misc]
        # "auto" without torchvision: no nvJPEG, no stage
        auto = device == "cuda" and plan.photo_stage == "auto" and importlib.util.find_spec("torchvision") is not None
        if auto or plan.photo_stage == "on":
            pipe.photo_limits = (settings.limits.max_upload_bytes, settings.limits.max_pixels)
        if auto:  # importing torchvision takes seconds: on a thread beside the warm-up's graph captures (cuDNN
            # planning releases the GIL); warmup() confirms the stage
            pipe._photo_check = start_photo_check()
            log.info("photo stage: checking torchvision's nvJPEG decoder beside the warm-up")
        elif device == "cuda":
            log.info("photo stage %s", "on" if pipe.photo_limits else "off")
        pipe.chunk = plan.cpu_chunk if device == "cpu" else None
        if device == "cpu" and plan.cpu_shards > 1:  # each part of a batch one row: the threads share it evenly
            pipe.pool = concurrent.futures.ThreadPoolExecutor(plan.cpu_shards, thread_name_prefix="facegate-cpu")
        return pipe

    def detect(self, images: Sequence[np.ndarray]) -> list[list[Detection]]:
        """``images``: list of ``(H, W, 3) uint8`` RGB → per image, detections sorted by score."""
        from facegate.pipeline.stages import DetectStage  # here: front-ends import this module without torch

        stage = DetectStage(self)  # execute runs in inference mode; prepare builds host canvases, as in the engine
        return stage.execute(stage.prepare(list(images)))

    @staticmethod
    def align(images: Sequence[np.ndarray], detections: Sequence[Detection], image_index: Sequence[int]) -> np.ndarray:
        """Crops ``(K, 112, 112, 3) uint8`` RGB for ``detections[k]`` found in ``images[image_index[k]]``."""
        return align_cpu(images, np.array([d.landmarks for d in detections], np.float32).reshape(-1, 5, 2), image_index)

    def embed(self, crops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``crops (K,112,112,3) uint8`` RGB → ``(emb (K,D) float32, quality (K,) float32, raw (K,) float32)``."""
        if crops.ndim != 4 or crops.shape[1:] != (112, 112, 3) or crops.dtype != np.uint8:
            raise InvalidParameterError(f"crops must be (K,112,112,3) uint8, got {crops.shape} {crops.dtype}")
        if len(crops) == 0:
            return EmbedOut(np.zeros((0, self.spec.embedding_dim + 2), np.float32))
        from facegate.pipeline.stages import EmbedStage

        stage = EmbedStage(self)  # as in the engine: pinned on CUDA, one device→host copy
        return stage.deliver(stage.execute(stage.prepare([crops])), 1)[0]

    def recognize(self, x: torch.Tensor) -> torch.Tensor:
        """``(K,112,112,3) uint8`` on the device → ``(K, D + 2) float32`` embedding | quality | raw."""
        import torch

        def run(part: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():  # thread-local: a pool thread enters it itself
                emb, q, raw = self.recognizer(part)
                return torch.cat([emb, q[:, None], raw[:, None]], dim=1).float()

        # parts of at most ``chunk`` rows, and with the pool one per thread at least: a forward of several rows reads
        # the recognizer's weights once for all of them
        n = max(-(-len(x) // self.chunk) if self.chunk else 1, self.pool._max_workers if self.pool else 1)
        outs = self.map(run, torch.tensor_split(x, max(1, min(n, len(x)))))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def map(self, fn: Callable[[Any], Any], parts: Sequence[Any]) -> list[Any]:
        """``fn`` over ``parts``, in order: on the CPU pool's threads at once (one intra-op thread each: no thread
        waits on another's inside an operator), else in turn."""
        if self.pool is None or len(parts) < 2:
            return [fn(p) for p in parts]
        return list(self.pool.map(fn, parts))

    def enrol_verdict(self, face: Face) -> QualityVerdict:
        """The face's verdict at the enrolment gate (:func:`~facegate.quality_reasons.enrol_verdict`)."""
        return enrol_verdict(face.quality, self.enrol_threshold)

    def make_faces(
        self,
        detections: Sequence[Detection | None],
        crops: np.ndarray | None,
        emb: np.ndarray,
        quality: np.ndarray,
        raw: np.ndarray,
        *,
        keep_crops: bool = False,
        stats: np.ndarray | None = None,
    ) -> list[Face]:
        """Gated :class:`Face` results from stage outputs: the quality gate with each face's reasons. ``stats``:
        ``(K, 3) float32`` :func:`crop_stats` rows when ``crops`` are absent (None: not seen)."""
        if crops is not None and len(crops):
            stats = crop_stats(crops)
        q, limits = self.operating.quality_threshold, self.reason_limits
        faces = []
        for i, det in enumerate(detections):
            score = float(quality[i])
            reasons = face_reasons(det, None if stats is None else stats[i], score, q, limits)
            verdict = quality_verdict(score, float(raw[i]), q, reasons, refuse_on_reasons=limits.refuse_on_reasons)
            crop = crops[i] if keep_crops and crops is not None else None
            faces.append(Face(detection=det, embedding=emb[i], quality=verdict, crop=crop))
        return faces

    def faces(self, images: Sequence[np.ndarray], *, keep_crops: bool = False) -> list[list[Face]]:
        """All stages on ``(H, W, 3) uint8`` photos; per image its largest face (NoFaceError for the first without)."""
        return self.faces_of(images, [select_faces(dets) for dets in self.detect(images)], keep_crops=keep_crops)

    def faces_of(
        self, images: Sequence[np.ndarray], chosen: Sequence[Sequence[Detection]], *, keep_crops: bool = False
    ) -> list[list[Face]]:
        """Gated faces of ``chosen[i]``, detections in ``images[i]``, aligned and embedded as one batch; per image."""
        flat = [d for sel in chosen for d in sel]
        owner = [i for i, sel in enumerate(chosen) for _ in sel]
        crops = self.align(images, flat, owner)
        out: list[list[Face]] = [[] for _ in images]
        for face, i in zip(self.make_faces(flat, crops, *self.embed(crops), keep_crops=keep_crops), owner, strict=True):
            out[i].append(face)
        return out

    def compare_faces(self, a: Face, b: Face) -> CompareResult:
        """1:1 compare; refused (never silently compared) when either face fails the quality gate."""
        op = self.operating
        if not (a.quality.accepted and b.quality.accepted):
            reasons = [f"img{i + 1}: {f.quality.reason}" for i, f in enumerate((a, b)) if not f.quality.accepted]
            return CompareResult(None, op.match_threshold, op.match_fmr, None, (a, b), True, "; ".join(reasons))
        sim = float(np.dot(a.embedding.astype(np.float64), b.embedding.astype(np.float64)))
        rel = None
        if self.reliability_weights is not None:
            rel = reliability(a.quality.score, b.quality.score, sim, op.match_threshold, self.reliability_weights)
        return CompareResult(
            sim, op.match_threshold, op.match_fmr, sim >= op.match_threshold, (a, b), False, reliability=rel
        )

    def stages(self) -> list[Any]:
        """The engine stages ``detect``, ``embed`` and, with :attr:`photo_limits`, ``photo``."""
        from facegate.pipeline.stages import DetectStage, EmbedStage

        stages: list[Any] = [DetectStage(self), EmbedStage(self)]
        if self.photo_limits is not None:
            from facegate.pipeline.photo import PhotoStage

            stages.append(PhotoStage(self, max_bytes=self.photo_limits[0], max_pixels=self.photo_limits[1]))
        return stages

    def warmup(self, *, driver_mib: Callable[[], float | None] | None = None) -> dict[str, dict[str, float]]:
        """Capture CUDA graphs and run every stage; per step its seconds and, on CUDA, allocated, reserved and
        ``driver_mib()`` MiB (kept in :attr:`warmup_report`)."""
        import torch

        report: dict[str, dict[str, float]] = {}
        cuda = self.device.type == "cuda"

        @contextlib.contextmanager
        def step(name: str) -> Iterator[None]:
            t0 = time.perf_counter()
            yield
            row = {"seconds": round(time.perf_counter() - t0, 3)}
            if cuda:
                torch.cuda.synchronize()
                row["allocated_mib"] = round(torch.cuda.memory_allocated() / 2**20, 1)
                row["reserved_mib"] = round(torch.cuda.memory_reserved() / 2**20, 1)
                got = driver_mib() if driver_mib is not None else None
                if got is not None:
                    row["driver_mib"] = round(got, 1)
            report[name] = row

        capture = getattr(self.recognizer, "capture", None)
        if capture is not None:
            with step("recognizer_graphs"):
                capture()
        rng = np.random.default_rng(0)
        det = self.detector
        if det.batch_buckets:  # plan (and capture) the detector's batch shapes of the warm-up photo sizes
            with step("detector_buckets"):
                for h, w in self.det_warm_sizes:
                    for b in self.detector_warm_batches(h, w):
                        self.detect([rng.integers(0, 255, (h, w, 3), dtype=np.uint8)] * b)
            if capture is None:  # eager CUDA recognizer: plan its bucket shapes too
                with step("recognizer_buckets"):
                    for b in det.batch_buckets:
                        self.embed(rng.integers(0, 255, (b, 112, 112, 3), dtype=np.uint8))
        with step("one_of_each"):
            self.detect([rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)])
            self.embed(rng.integers(0, 255, (1, 112, 112, 3), dtype=np.uint8))
        if self._photo_check is not None:  # without nvJPEG the stage goes (front-ends learn the stages after warm-up)
            with step("photo_check_wait"):
                check, self._photo_check = self._photo_check, None
                if check():
                    log.info("photo stage on (torchvision checked beside the warm-up)")
                else:
                    log.warning("photo stage off: torchvision's nvJPEG decoder did not load (host decode and align)")
                    self.photo_limits = None
        if self.photo_limits is not None:  # nvJPEG's decoder state, the canvas/warp kernels, each detector bucket
            import cv2

            with step("photo_stage"):
                photo = next(st for st in self.stages() if st.name == "photo")
                _, buf = cv2.imencode(".jpg", rng.integers(0, 255, (250, 250, 3), dtype=np.uint8))
                for n in sorted({1, *self.detector_warm_batches(250, 250)}):
                    photo.execute(photo.prepare([buf.reshape(-1)] * n))
        if cuda:  # hand warm-up's transient activations back to the driver
            with step("empty_cache"):
                torch.cuda.empty_cache()
        self.warmup_report = report
        return report

    def detector_warm_batches(self, height: int, width: int) -> list[int]:
        """Photos per warm-up detect call for one size: each batch bucket up to what one forward takes under
        the detector's ``max_batch_pixels``."""
        hp, wp = self.detector.padded_hw(height, width)
        max_pixels = self.detector.max_batch_pixels
        cap = max_pixels // (hp * wp) if max_pixels else None
        buckets = self.detector.batch_buckets or (1,)
        fit = [b for b in buckets if cap is None or b <= max(cap, 1)]
        if cap is not None and cap >= 1 and cap not in fit and any(b > cap for b in buckets):
            fit.append(cap)  # the partly filled bucket a full forward of this size pads to
        return sorted(set(fit))
