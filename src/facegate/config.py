"""The one configuration object.

Every knob lives here, with a default, a bound and a docstring (the ``description``). Values come from,
in increasing priority: defaults, ``FACEGATE_*`` environment variables, and explicit keyword arguments
(which the CLI flags fill). Example: ``FACEGATE_MAX_BATCH_SIZE=128 facegate serve``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "fp16", "bf16"]
CompileMode = Literal["off", "graphs", "inductor"]


class ServerSettings(BaseModel):
    """How the HTTP server stops. Environment: ``FACEGATE_SERVER__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    drain_timeout_s: float = Field(
        10.0,
        ge=0.0,
        le=600.0,
        description=(
            "On SIGTERM/SIGINT the server stops accepting and lets the requests already admitted run for at most "
            "this many seconds; requests that arrive meanwhile, and those still running then, get a JSON 503 "
            "`shutting_down`. The process then exits with status 0. Set it below your orchestrator's kill grace "
            "period (Kubernetes: terminationGracePeriodSeconds, systemd: TimeoutStopSec) minus a few seconds."
        ),
    )


class MetricsSettings(BaseModel):
    """What ``/metrics`` exposes. Environment: ``FACEGATE_METRICS__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    gallery_labels: bool = Field(
        False,
        description=(
            'Export each gallery\'s subject count as `facegate_gallery_subjects{gallery="<name>"}`. Off, only the '
            "total over all galleries is exported (no label), so a scrape does not reveal gallery names."
        ),
    )


class Settings(BaseSettings):
    """All facegate settings. Environment prefix: ``FACEGATE_``."""

    model_config = SettingsConfigDict(
        env_prefix="FACEGATE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    # ------------------------------------------------------------------ models
    model: str = Field("sface", min_length=1, description="Recognizer name in the model registry.")
    rts_checkpoint: Path | None = Field(
        None, description="Path to a ModelScope RTS IR-SE-64 `pytorch_model.pt`; selects model 'irse64_rts'."
    )
    quality_head: Path | None = Field(
        None, description="Path to a trained quality-head file; overrides the registry's default head."
    )
    device: Device = Field("auto", description="'auto' picks CUDA when available, else CPU.")
    precision: Precision = Field("fp32", description="Compute precision of the models on the device.")
    compile: CompileMode = Field(
        "off",
        description=(
            "CUDA only. 'graphs': capture CUDA graphs of the eager kernels over fixed batch buckets; "
            "'inductor': torch.compile (Inductor max-autotune, freezing, 1x1 convs as matmuls) first, then "
            "capture graphs: SFace fp16 ran 61.4k faces/s at batch 64 on the H200 against 28.0k for 'graphs', "
            "but autotuning the batch-64 shape took 222 s before TORCHINDUCTOR_CACHE_DIR held its kernels "
            "(16 s after; every bucket is a shape); "
            "'off': plain eager."
        ),
    )
    gemm_workspace: Literal["none", "default"] = Field(
        "none",
        description=(
            "CUDA: cuBLAS workspaces of the process. 'none' sets CUBLAS_WORKSPACE_CONFIG=:0:0 and "
            "CUBLASLT_WORKSPACE_SIZE=0 before the first GEMM (unless already set): PyTorch otherwise keeps a "
            "workspace per thread and stream that ran a GEMM (+96 MiB for the first on the H200). The models' "
            "only GEMMs are their embedding heads. 'default': PyTorch's workspaces."
        ),
    )
    activation_budget_mib: float | None = Field(
        None,
        ge=1.0,
        le=65536.0,
        description=(
            "Bound on the recognizer's activations per forward, in MiB: its full-resolution first stages run in "
            "sub-batches sized to fit, the rest on the whole batch (models/chunked.py), so a batch of "
            "max_batch_size needs far less GPU memory at some cost in speed (docs/benchmarks.md, memory). "
            "None: every batch in one pass."
        ),
    )
    gpu_memory_limit_mib: int | None = Field(
        None,
        ge=16,
        le=1 << 22,
        description=(
            "CUDA: cap on the GPU memory PyTorch's allocator of the engine process may hold, weights, CUDA-graph "
            "pools and cache included (torch.cuda.set_per_process_memory_fraction). Past it the allocator first "
            "returns its cached blocks; a batch that still does not fit fails with HTTP 503 (engine_error), and "
            "the engine keeps serving. A cap too small to load and warm up the models stops the start-up with an "
            "error that names it. The CUDA context and the libraries' kernels come on top. None: no cap."
        ),
    )
    gpu_arena_mib: int | None = Field(
        None,
        ge=2,
        le=1 << 20,
        description=(
            "CUDA: reserve one allocator segment of this many MiB before the models load (reserve_arena). "
            "PyTorch's caching allocator gives each new group of 1-10 MiB blocks a fresh 20 MiB segment; "
            "with an arena the weights' and the activations' large blocks are carved from the one segment "
            "instead. Size it to the large weights plus the largest forward's activations (for a small "
            "footprint, with activation_budget_mib; docs/benchmarks.md, memory). None: no arena."
        ),
    )
    gpu_allocator: Literal["default", "expandable"] = Field(
        "default",
        description=(
            "CUDA: PyTorch's caching allocator. 'expandable' sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "(unless the variable is set): segments grow in place rather than new ones being created. On the H200 "
            "it did not make caps of 44-48 MiB hold (runs 40-41: out of memory either way). 'default': as is."
        ),
    )
    graph_buckets: list[int] = Field(
        default_factory=lambda: [4, 16, 32, 64],
        min_length=1,
        max_length=16,
        description=(
            "Batch sizes captured as CUDA graphs (and, on CUDA, the detector's batch sizes); batches are padded "
            "up to the next bucket. Each bucket costs warm-up time: cuDNN plans SFace's depthwise convs for "
            "1.5-2 s per batch size on the H200 (IR-SE-64 and the detector: 0.05-0.6 s). No bucket of 1 by "
            "default: a lone crop padded to 4 costs ~0.1 ms of GPU time, the bucket ~2 s of every cold start. "
            "The 32 bucket: three engine processes batch ~20 photos at concurrency 100, which were padded to 64 "
            "rows (H200, run 27: 1.08x compare req/s at c=100, 1.01x at c=256)."
        ),
    )

    channels_last: bool = Field(
        True,
        description=(
            "Recognizer in channels_last (NHWC) on CUDA at fp16/bf16. Faster steady state on tensor cores, but "
            "cuDNN plans each new NHWC batch shape for seconds: with compile=off, warm-up pre-plans the buckets."
        ),
    )
    fused_epilogues: bool = Field(
        True,
        description=(
            "CUDA: SFace's conv bias and PReLU in one Triton kernel per layer (models/epilogue.py) instead of "
            "two PyTorch kernels, and YuNet's 1x1-conv biases (and its stem's ReLU) in one vectorised pass "
            "instead of a broadcast add; the same maths as torch operations where Triton is missing. H200, "
            "run 26: three engine processes served 1.28x the compare requests at concurrency 100 (p99 51 "
            "against 65 ms), 1.29x at 256. compile='inductor' fuses the recognizer by itself and ignores this for it."
        ),
    )
    fused_depthwise: bool = Field(
        True,
        description=(
            "CUDA, with fused_epilogues: each of YuNet's depthwise 3x3 convolutions (fp32, NCHW) runs with the "
            "preceding 1x1 conv's bias, its own bias and its ReLU in one Triton kernel instead of PyTorch's "
            "generic depthwise kernel plus two passes (models/epilogue.py, depthwise3x3). H200: photo-stage device "
            "time 0.85x; compare req/s 1.06x/1.13x at concurrency 100/256 in run 29, 1.01x/1.03x in run 32."
        ),
    )
    flip_tta: bool = Field(
        False,
        description="Also embed the mirrored crop and sum both embeddings (2× recognizer compute, +accuracy).",
    )

    # ------------------------------------------------------------------ detector
    det_score_threshold: float = Field(0.6, ge=0.0, le=1.0, description="Minimum detector score.")
    det_nms_threshold: float = Field(0.3, ge=0.0, le=1.0, description="IoU threshold of non-maximum suppression.")
    det_top_k: int = Field(5000, ge=1, le=100_000, description="Candidates kept before NMS.")
    det_max_side: int = Field(
        640, ge=64, le=4096, description="Images are scaled so their longer side is at most this before detection."
    )
    det_graphs: bool = Field(
        True,
        description=(
            "With compile != off on CUDA, also run the detector as CUDA graphs (one per batch shape). Cuts "
            "the detect stage's Python time ~15× under load (H200), at the cost of the graphs' memory pool."
        ),
    )
    det_channels_last: bool | None = Field(
        None,
        description=(
            "Detector layout. None: NHWC (channels_last) on the CPU, where YuNet's depthwise convs run several "
            "times faster, and NCHW on CUDA, where cuDNN plans each new NHWC input shape for 2-4 s (H200) and "
            "an NCHW one in milliseconds, at equal steady-state speed."
        ),
    )
    det_max_batch_pixels: int = Field(
        16 * 256 * 256,
        ge=256 * 256,
        le=2**28,
        description=(
            "Largest detector forward, in padded input pixels (rows × height × width): batches are split so "
            "activation memory stays bounded (the default fits 16 LFW photos or 2 photos of 640×640; 64 LFW "
            "photos cost ~530 MiB more GPU memory on the H200, benchmarks/results/serve_memory_gpu.json). A "
            "photo larger than this still runs, alone. YuNet's fp32 activations peak near 12 MiB per LFW photo."
        ),
    )
    photo_detect_in_prepare: bool = Field(
        True,
        description=(
            "CUDA photo stage: enqueue each batch's detector forwards at the end of its prepare step (engine front "
            "thread), so the device detects batch k+1 while the back thread runs NMS, alignment and the "
            "recognizer of batch k; off: detect inside execute, as before (benchmarks/photo_profile.py A/B)."
        ),
    )
    photo_select_on_device: bool = Field(
        True,
        description=(
            "Photo stage: run NMS, the largest-face choice and the alignment as tensor operations on the engine's "
            "device, inside the detector's CUDA graph, so the host waits once per batch instead of doing that work "
            "between two waits (pipeline/photo_select.py; the same rule as the host path, which still answers "
            "photos the device cannot settle exactly). H200, run 25: one engine process served 1.33x the compare "
            "requests at concurrency 100 (p99 69 against 113 ms) and 1.29x at 256; three engines 1.03x and 0.95x."
        ),
    )
    photo_warp_mib: int | None = Field(
        16,
        ge=1,
        le=1 << 20,
        description=(
            "Photo stage on a device: convert at most this many MiB of photos to float32 at once to warp their faces "
            "(runs of photos of that size; None: a whole batch at once). 64 LFW photos are 46 MiB in float32, the "
            "largest block of the stage's peak (run 45); the warp is exact either way, a run costs a few kernel "
            "launches."
        ),
    )
    photo_decode: Literal["nvjpeg", "host"] = Field(
        "nvjpeg",
        description=(
            "Photo stage on CUDA: 'nvjpeg' decodes JPEG uploads on the GPU (torchvision's decoder, which "
            "synchronises its stream at the start and the end of every batch); 'host' decodes them with Pillow on "
            "photo_decode_threads threads of the engine process and copies the pixels to the GPU through pinned "
            "memory without waiting. H200, run 28 (three engines): 'host' served 0.66x the compare requests of "
            "'nvjpeg' at concurrency 100 and 0.54x at 256 (the CPU decode costs more than nvJPEG's waits)."
        ),
    )
    photo_decode_threads: int = Field(
        4, ge=1, le=64, description="Threads of the engine process that decode photos when photo_decode='host'."
    )
    det_warm_sizes: list[tuple[int, int]] = Field(
        default_factory=lambda: [(250, 250)],
        min_length=1,
        max_length=16,
        description=(
            "Photo sizes (height, width) whose detector batch shapes warm-up plans and captures on CUDA, at every "
            "batch bucket the pixel cap allows. Any other padded size is captured the first time it arrives (up "
            "to 32 shapes), which stalls that batch ~0.1 s on the H200 (cuDNN plans per shape; 2-4 s with "
            "det_channels_last): list the sizes your cameras send, e.g. [[480, 640], [720, 1280]]. Each shape adds "
            "as much to the cold start. Default: "
            "LFW's 250×250 (and one 480×640 photo, which warm-up always runs)."
        ),
    )

    gpu_preprocess: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "JPEG uploads (compare, search, enrol, embed of the largest face) go to the engine's 'photo' stage "
            "as encoded bytes: nvJPEG decode, detection on a device canvas and alignment as a batched warp, all "
            "on the engine's device (facegate.pipeline.photo). 'auto': on with a CUDA engine when torchvision's "
            "nvJPEG decoder loads; 'on': also on the CPU (same code, torch ops); 'off': the front-ends decode "
            "and align with OpenCV on the host."
        ),
    )

    # ------------------------------------------------------------------ thresholds
    match_threshold: float | None = Field(
        None, ge=-1.0, le=1.0, description="Cosine match threshold; None uses the model's calibrated one."
    )
    quality_threshold: float | None = Field(
        None, ge=0.0, le=1.0, description="Quality gate in [0,1]; None uses the model's calibrated one."
    )
    enrol_requires_quality: bool = Field(True, description="Enrolment refuses faces below the quality gate.")

    # ------------------------------------------------------------------ engine / batching
    max_batch_size: int = Field(64, ge=1, le=4096, description="Largest batch the engine forms for one stage.")
    max_wait_ms: float = Field(
        2.0, ge=0.0, le=1000.0, description="How long the engine waits to fill a batch after the first item."
    )
    max_queue: int = Field(4096, ge=1, le=1_000_000, description="Bounded queue size; beyond it requests get 503.")
    request_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="Per-request deadline; expired work is dropped before compute (504)."
    )
    batching: bool = Field(True, description="Cross-request dynamic batching; False runs each request alone.")
    shared_device_thread: bool = Field(
        True,
        description=(
            "Build the models, warm them up and run every engine stage's device work on one thread, instead of a "
            "thread per stage. Each thread that launches cuDNN/cuBLAS work holds its own library handles and "
            "cuBLAS workspace in GPU memory: one thread held 46 MiB less after load in the default serving mode "
            "at the same req/s (HTTP run 53), 24 MiB less in the low-memory mode (run 52). False: a device "
            "thread per stage, so the stages overlap their launch work (docs/benchmarks.md, memory)."
        ),
    )
    cpu_chunk: int = Field(
        4,
        ge=1,
        le=4096,
        description=(
            "On the CPU, the largest sub-batch one forward gets (engine batches are split): per-face speed "
            "falls at large CPU batches (benchmarks/results/cpu_models.json: batch 16 below batch 1)."
        ),
    )
    decode_workers: int = Field(4, ge=1, le=256, description="Threads for image decode and preprocessing.")
    engines: int = Field(
        1,
        ge=1,
        le=16,
        description=(
            "Engine processes, engines_per_gpu per GPU: engine i runs on CUDA device i // engines_per_gpu (of "
            "CUDA_VISIBLE_DEVICES when set). More than 1 implies the process model (at least 2 front-ends); "
            "front-ends send each request to the engine with the fewest requests in flight."
        ),
    )
    engines_per_gpu: int = Field(
        1,
        ge=1,
        le=4,
        description=(
            "Engine processes sharing one GPU. An engine process's threads share one GIL, which bounds it near "
            "one CPU core (H200 runs: GPU 35-50 % busy under aligned-crop load); a second engine on the same "
            "GPU doubles that at the cost of a second copy of the models, graphs and CUDA context in GPU memory."
        ),
    )
    gallery_open_retry_s: float = Field(
        60.0,
        ge=0.0,
        le=3600.0,
        description=(
            "How long opening the SQLite gallery retries while another process keeps the file locked. Past it, a "
            "serving process answers without the gallery (gallery routes: 503 gallery_unavailable) and keeps "
            "retrying in the background; any other gallery error at start-up fails the start-up."
        ),
    )
    compare_same_engine: bool = Field(
        True,
        description=(
            "Process model with several engines: send both photos of a compare to one engine process (the least "
            "busy when the first is sent). Off: each photo goes to the least busy engine, and the answer waits for "
            "the slower of the two."
        ),
    )
    engine_drain_s: float = Field(
        15.0,
        ge=0.0,
        le=600.0,
        description=(
            "Process model: an engine process that gets SIGTERM/SIGINT while front-ends are still connected (a "
            "signal to the whole process group, e.g. Ctrl-C) keeps serving until they have gone, for at most this "
            "long, so their in-flight requests finish; a second signal stops it at once."
        ),
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Front-end processes. 1: one process does HTTP, decoding and the engine. ≥ 2: one engine process "
            "owns the device and this many front-end processes (HTTP, decode, align, gallery) feed it through "
            "shared memory (facegate.engine.remote), so the engine's threads do not compete for one GIL."
        ),
    )
    fast_path: bool = Field(
        True,
        description=(
            "Serve aligned-crop embeds (POST /api/embed, aligned=true, images only) below FastAPI's routing, "
            "with the route's own function and JSON (facegate.serving.fastpath); other requests are unchanged. "
            "Off: every request goes through FastAPI."
        ),
    )
    accept: Literal["balanced", "shared"] = Field(
        "balanced",
        description=(
            "How connections reach the front-end processes (workers ≥ 2). balanced: the supervisor accepts "
            "each connection and hands it to the front-end with the fewest open connections "
            "(facegate.serving.acceptor). shared: every front-end accepts on one shared socket, uvicorn's way; "
            "on the H200 two of 8 front-ends then took 94 % of 100 keep-alive clients (run 33)."
        ),
    )
    cpu_threads: int | None = Field(
        None,
        ge=0,
        le=1024,
        description=(
            "Intra-op threads of torch and OpenCV in the serving processes (the engine's and the front-ends'). "
            "None: 1 with a CUDA engine (the CPU side only decodes and preprocesses, in small per-image "
            "operations, after each of which idle pool threads spin: benchmarks/results/cpu_pool_spin.json), "
            "the libraries' defaults on the CPU device; 0: the libraries' defaults; n: n threads."
        ),
    )
    gil_switch_interval_ms: float = Field(
        1.0,
        ge=0.05,
        le=100.0,
        description=(
            "``sys.setswitchinterval`` for the serving process, in ms (Python's default is 5). The engine's "
            "execute thread waits up to this long for the GIL each time it gets it back from the HTTP thread."
        ),
    )

    http_parser: Literal["auto", "httptools", "h11"] = Field(
        "auto",
        description=(
            "uvicorn's HTTP/1.1 parser in the serving processes: 'auto' takes httptools (C) when installed "
            "(a dependency of facegate), else h11 (pure Python)."
        ),
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="The serving processes' event loop: 'auto' takes uvloop when installed (not on Windows).",
    )
    gc_freeze: bool = Field(
        True,
        description=(
            "After start-up, collect once and freeze every live object into the garbage collector's permanent "
            "generation (gc.freeze), in the engine and front-end processes alike. A serving process holds some "
            "200k start-up objects (torch, the models); each full collection walked them all, 78 ms with the GIL "
            "held, one per ~9,000 request futures (benchmarks/results/gc_pause_cpu.json). On the H200: 1.13x "
            "compare req/s, p99 102 against 254 ms (run 11). Off: Python's default collector."
        ),
    )

    # ------------------------------------------------------------------ input limits
    max_upload_bytes: int = Field(
        20 * 1024 * 1024, ge=1024, le=1 << 31, description="Largest accepted upload per image, in bytes."
    )
    max_pixels: int = Field(
        40_000_000, ge=4096, le=1_000_000_000, description="Largest accepted image, in pixels (width × height)."
    )
    max_images_per_request: int = Field(64, ge=1, le=10_000, description="Most images in one embed request.")
    allowed_roots: list[Path] = Field(
        default_factory=list, description="Server-side folders the API may read from; empty forbids paths."
    )

    # ------------------------------------------------------------------ serving / storage
    host: str = Field("127.0.0.1", description="Bind address of `facegate serve`.")
    port: int = Field(7860, ge=1, le=65535, description="Port of `facegate serve`.")
    data_dir: Path = Field(Path("./data"), description="Where the SQLite gallery and caches live.")
    gallery_url: str | None = Field(
        None, description="Gallery database URL; None means SQLite at `<data_dir>/gallery.sqlite3`."
    )

    server: ServerSettings = Field(default_factory=ServerSettings, description="Shutdown: the drain of requests.")
    metrics: MetricsSettings = Field(default_factory=MetricsSettings, description="What /metrics exposes.")

    # ------------------------------------------------------------------ evaluation
    lfw_root: Path | None = Field(
        None, description="LFW root (holds lfw-deepfunneled/ and pairs.txt); for eval and tests only."
    )

    def resolved_device(self) -> str:
        """``'cuda'`` or ``'cpu'`` after resolving ``'auto'``."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
