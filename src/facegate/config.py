"""The user settings.

Values come from, in increasing priority: defaults, ``FACEGATE_*`` environment variables (nested groups with a
double underscore, e.g. ``FACEGATE_LIMITS__MAX_UPLOAD_BYTES``), and explicit keyword arguments (which the CLI
flags fill). Everything that follows from the machine (process counts, kernel choices, memory plans) is not a
setting: :mod:`facegate.tuning` derives it from these and the device, in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Limits(_Group):
    """What one request may ask for, and how long it may take."""

    max_upload_bytes: int = Field(20 * 1024 * 1024, ge=1024, le=1 << 31)
    """Largest accepted upload per image, in bytes (413 above)."""
    max_pixels: int = Field(40_000_000, ge=4096, le=1_000_000_000)
    """Largest accepted image, in pixels (width × height); larger images are refused with 413."""
    max_images_per_request: int = Field(64, ge=1, le=10_000)
    """Most images in one embed request."""
    request_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Deadline of one request from its arrival, in seconds; work past it is dropped unrun (504)."""
    max_queue: int = Field(4096, ge=1, le=1_000_000)
    """Items the engine queues per stage; past it new requests are refused with 503 (queue_full)."""
    allowed_roots: list[Path] = Field(default_factory=list)
    """Server-side folders the API may read images from by path; empty forbids paths."""
    max_admitted: int = Field(512, ge=1, le=1_000_000)
    """Most /api requests one front-end process works on at once. Below it the process also admits no more than
    what it finishes in a tenth of a second with GPU engine processes, half a second on the CPU or in one process
    (at least 4), measured as it runs.
    Excess requests get 503 with Retry-After at once, before their body is read."""
    request_pixels: int = Field(100_000_000, ge=4096, le=10_000_000_000)
    """Decoded pixels (width × height, read from the image headers before decoding) one request may carry summed over
    its images; beyond it 413. An RGB pixel takes 3 bytes once decoded."""
    decode_pixels_in_flight: int = Field(400_000_000, ge=4096, le=100_000_000_000)
    """Decoded pixels all requests of one front-end process may hold at once; a request waits (within its deadline)
    until its images fit. Bounds the decode memory of a process at about 3 bytes each."""
    json_max_bytes: int = Field(256 * 1024, ge=1024, le=1024 * 1024)
    """Largest JSON body or JSON form field, in bytes (at most 1 MiB, the body limit of routes without images)."""
    json_max_depth: int = Field(32, ge=2, le=1000)
    """Deepest nesting of arrays and objects in JSON."""
    json_max_number_digits: int = Field(64, ge=8, le=4300)
    """Longest number literal in JSON, in characters; longer ones get 4xx."""


class EngineSettings(_Group):
    """How the engine batches work across requests and how it stops."""

    max_batch_size: int = Field(64, ge=1, le=4096)
    """Largest batch the engine forms for one stage."""
    max_wait_ms: float = Field(2.0, ge=0.0, le=1000.0)
    """How long, in ms, the engine waits after a batch's first item for more to fill it. On the CPU a batch with a
    row for each core waits no longer while a core is free."""
    gpu_memory_limit_mib: int | None = Field(None, ge=16, le=1 << 22)
    """CUDA: the most GPU memory, in MiB, PyTorch's allocator of an engine process may hold (weights and graph pools
    included; the CUDA context comes on top). A batch that does not fit fails with 503 and the engine keeps serving;
    a cap too small to load the models stops the start-up. None: no cap."""


class DetectorSettings(_Group):
    """The face detector's decision rule and the photo sizes it prepares for."""

    score_threshold: float = Field(0.6, ge=0.0, le=1.0)
    """Minimum detector score of a face."""
    nms_threshold: float = Field(0.3, ge=0.0, le=1.0)
    """IoU above which non-maximum suppression drops the weaker of two boxes."""
    top_k: int = Field(5000, ge=1, le=100_000)
    """Candidates kept before non-maximum suppression."""
    max_side: int = Field(640, ge=64, le=4096)
    """Images are scaled so their longer side is at most this many pixels."""
    warm_sizes: list[tuple[int, int]] = Field(default_factory=lambda: [(250, 250)], min_length=1, max_length=16)
    """Photo sizes (height, width) whose detector shapes the start-up prepares on CUDA; another size is prepared when it
    first arrives, which stalls that batch briefly. List the sizes your cameras send, e.g. [[480, 640], [720, 1280]];
    each adds to the start-up time."""


class QualitySettings(_Group):
    """The quality gates and the limits behind a face's reasons (``Settings.quality``).

    Environment: ``FACEGATE_QUALITY__MIN_IOD_PX=32`` (or the whole group as JSON in ``FACEGATE_QUALITY``).
    Each limit is measured on labelled LFW variants (``docs/quality.md``); a face that misses one is told why.
    """

    model_config = ConfigDict(frozen=True)

    refuse_on_reasons: bool = True
    """Refuse a face that misses any limit below, as well as one below the quality gate. Off: the reasons are still
    listed, and only the quality score gates."""
    min_iod_px: float = Field(15.1, ge=0.0, le=1000.0)
    """Least distance between the eyes, in source pixels."""
    max_yaw_deg: float = Field(50.0, ge=0.0, le=90.0)
    """Largest left-right head turn, in degrees."""
    max_pitch_deg: float = Field(40.0, ge=0.0, le=90.0)
    """Largest up-down head tilt, in degrees."""
    min_sharpness: float = Field(0.8, ge=0.0, le=1000.0)
    """Least sharpness: 100 × the variance of the Laplacian of the aligned face's grey levels over their variance (clean
    LFW faces score 3-24)."""
    min_luma: float = Field(27.8, ge=0.0, le=255.0)
    """Least mean brightness of the face (0-255)."""
    max_luma: float = Field(216.4, ge=0.0, le=255.0)
    """Largest mean brightness of the face (0-255)."""
    max_flat: float = Field(0.38, ge=0.0, le=1.0)
    """Largest fraction of flat, textureless blocks in the worse of the eyes' strip and the nose-and-mouth strip of
    the aligned face (a mask or an eye band makes one of them flat)."""
    min_det_score: float = Field(0.6, ge=0.0, le=1.0)
    """Least detector confidence, in [0, 1]: YuNet's sqrt(class probability × objectness) of the face. The default is
    the detector's own threshold (it finds no face below it), so by default only a face partly outside the photo is
    refused as low_confidence; docs/quality.md gives the limit measured on LFW (about 0.86)."""
    max_outside_photo: float = Field(0.186, ge=0.0, le=1.0)
    """Largest share (0-1) of the face region the landmarks imply (brows to chin, cheek to cheek, as in the aligned
    crop) that may lie outside the photo; more is a face partly outside the photo."""
    enrol_gate: float | None = Field(None, ge=0.0, le=1.0)
    """Least quality an enrolment photo needs. Stricter than the verify gate (quality_threshold), since a poor enrolment
    hurts every later comparison. None: the measured enrolment gate when a verify gate is in force, else no stricter
    gate."""
    enrol_requires_quality: bool = True
    """Enrolment refuses faces below the enrolment gate; False enrols every face found."""


class SecuritySettings(_Group):
    """Who may call the API, and what browsers may do with it (``Settings.security``)."""

    keys_file: Path | None = None
    """File of hashed API keys (`facegate keys create|list|revoke`). None: `<data_dir>/api_keys.json`. With at least one
    key every /api route needs one; with none the server listens on loopback only."""
    no_auth: bool = False
    """Serve without API keys on any address (`facegate serve --no-auth`): every client may enrol, delete and search.
    Without it, binding a non-loopback address with no keys refuses to start."""
    allowed_origins: list[str] = Field(default_factory=list)
    """Browser origins (`https://app.example`) besides the server's own that may send state-changing requests (POST,
    PUT, PATCH, DELETE); a request from any other Origin gets 403."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Host header values the server answers (`facegate.example`, `10.0.0.5:7860`; `*` for any), against DNS rebinding.
    Empty: loopback names only when bound to loopback, any host otherwise."""
    metrics_access: Literal["open", "key"] = "open"
    """/metrics: 'open' to anyone, or 'key': only with a valid API key (any scope)."""
    metrics_gallery_labels: bool = False
    """Export each gallery's subject count as `facegate_gallery_subjects{gallery="<name>"}`. Off, only the total over
    all galleries is exported (no label), so a scrape does not reveal gallery names."""
    rate_limit_per_s: float | None = Field(None, gt=0.0, le=1e6)
    """Requests per second each API key (or each client address, without keys) may make on average to /api routes;
    beyond it 429 with Retry-After. None: no rate limit."""
    rate_limit_burst: int = Field(20, ge=1, le=1_000_000)
    """Requests a key may make at once above its rate (token-bucket size)."""


class Settings(BaseSettings):
    """All user settings. Environment prefix: ``FACEGATE_``."""

    model_config = SettingsConfigDict(
        env_prefix="FACEGATE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=True,
    )

    # ------------------------------------------------------------------ models
    model: str = Field("sface", min_length=1)
    """Recognizer name in the model registry."""
    rts_checkpoint: Path | None = None
    """Path to a ModelScope RTS IR-SE-64 `pytorch_model.pt`; selects model 'irse64_rts'."""
    quality_head: Path | None = None
    """Path to a trained quality-head file; overrides the registry's default head."""
    flip_tta: bool = False
    """Also embed the mirrored crop and sum both embeddings (2× recognizer compute)."""

    # ------------------------------------------------------------------ how to run
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto': CUDA when a GPU and a CUDA build of torch are present."""
    profile: Literal["auto", "throughput", "low-memory", "cpu"] = "auto"
    """The serving plan (facegate.tuning). 'throughput': the fastest configuration for the device (on CUDA fp16, CUDA
    graphs, fused kernels, several front-ends and engines); 'low-memory': the smallest GPU footprint, one process;
    'cpu': the CPU plan; 'auto': 'throughput' on CUDA, 'cpu' otherwise."""
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    """Recognizer precision; 'auto': the profile's (fp16 on CUDA; on the CPU bf16 where it has AMX, else fp32)."""
    compile: Literal["auto", "off", "graphs", "inductor"] = "auto"
    """CUDA: 'graphs' replays CUDA graphs of the eager kernels; 'inductor' compiles with torch.compile first (faster,
    minutes of start-up without a warm TORCHINDUCTOR_CACHE_DIR); CPU: any but 'off' freezes the recognizer as one
    TorchScript graph; 'off': eager; 'auto': the profile's."""
    workers: int | None = Field(None, ge=1, le=64)
    """Front-end processes (HTTP, decoding, policy). 1: one process also runs the engine. None: the plan's."""
    engines: int | None = Field(None, ge=1, le=16)
    """Engine processes in all (engines_per_gpu per GPU); more than 1 needs workers ≥ 2. None: plan's."""
    engines_per_gpu: int | None = Field(None, ge=1, le=4)
    """Engine processes sharing one GPU; each holds its own copy of the models. None: the plan's."""
    gpu_preprocess: Literal["auto", "on", "off"] = "auto"
    """Where photo uploads are decoded and aligned. 'on': in the engine, on its device (nvJPEG on CUDA); 'off': in the
    front-ends, on the host; 'auto': on with a CUDA engine whose nvJPEG decoder loads, unless the profile is
    'low-memory'."""

    # ------------------------------------------------------------------ thresholds
    match_threshold: float | None = Field(None, ge=-1.0, le=1.0)
    """Cosine match threshold; None uses the model's calibrated one."""
    quality_threshold: float | None = Field(None, ge=0.0, le=1.0)
    """Quality gate in [0,1]; None uses the model's calibrated one."""
    quality: QualitySettings = Field(default_factory=QualitySettings)
    """Quality gates and the limits behind a face's reasons."""

    # ------------------------------------------------------------------ groups
    limits: Limits = Field(default_factory=Limits)
    """What one request may ask for, and its deadline."""
    engine: EngineSettings = Field(default_factory=EngineSettings)
    """How the engine batches work, stops, and caps its GPU memory."""
    detector: DetectorSettings = Field(default_factory=DetectorSettings)
    """The face detector's decision rule and warm-up sizes."""

    # ------------------------------------------------------------------ serving / storage
    host: str = "127.0.0.1"
    """Bind address of `facegate serve`."""
    port: int = Field(7860, ge=1, le=65535)
    """Port of `facegate serve`."""
    data_dir: Path = Field(Path("./data"))
    """Where the SQLite gallery and caches live."""
    gallery_url: str | None = None
    """Gallery store: `postgresql://user:password@host/db` for PostgreSQL (several engines or hosts share it),
    `sqlite:///path` for SQLite on one host; None means SQLite at `<data_dir>/gallery.sqlite3`."""
    gallery_open_retry_s: float = Field(60.0, ge=0.0, le=3600.0)
    """Seconds opening the gallery store retries while it is locked or unreachable; past it the server answers gallery
    routes with 503 gallery_unavailable and keeps retrying in the background."""
    drain_s: float = Field(10.0, ge=0.0, le=600.0)
    """On SIGTERM/SIGINT the server stops accepting and lets the requests already admitted run for at most this many
    seconds; requests that arrive meanwhile, and those still running then, get a JSON 503 `shutting_down`, and the
    process exits with status 0. Engine processes keep serving their front-ends until these have stopped. Set it a
    few seconds below your orchestrator's kill grace period (Kubernetes: terminationGracePeriodSeconds, systemd:
    TimeoutStopSec)."""
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    """API keys, browser safety, rate limits and /metrics access."""
