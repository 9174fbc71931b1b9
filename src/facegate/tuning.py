"""The serving plan: every internal tuning value, derived in one place (:func:`make_plan`) from the settings and
the machine (a usable CUDA build and GPUs, CPU cores). Nothing here imports torch or reads the environment but
``CUDA_VISIBLE_DEVICES``: the supervisor and the front-ends plan too. The engine processes get the supervisor's
plan. Profiles:

- ``throughput`` (the default on CUDA): fp16, CUDA graphs, fused kernels, the detector in graphs, three engine
  processes per GPU and about one front-end per two cores, large detector batches.
- ``low-memory``: the smallest GPU footprint: eager fp16, a bounded recognizer activation budget inside one
  pre-reserved allocator segment, small detector batches, host-side photo preprocessing, one process.
- ``cpu`` (the default without CUDA): fp32, one intra-op thread and one device thread per core; each batch's rows
  run at once on as many threads, through ONNX Runtime's detector and the recognizer frozen as one TorchScript graph.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from facegate.config import Settings

PlanProfile = Literal["throughput", "low-memory", "cpu"]

#: Engine processes per GPU in the throughput plan: one engine process's threads share one GIL, which bounds
#: it near one CPU core; three keep one GPU busy under photo load.
ENGINES_PER_GPU = 3
# Largest detector forwards, in padded input pixels: 64 LFW-sized photos for throughput, 16 (or 2 of 640×640)
# by default, one for low-memory.
THROUGHPUT_DET_BATCH_PIXELS = 4_194_304
DEFAULT_DET_BATCH_PIXELS = 16 * 256 * 256
LOW_MEMORY_DET_BATCH_PIXELS = 65_536
#: Low-memory recognizer activation budget and allocator arena in MiB, per model (the rest: the default key).
LOW_MEMORY_BUDGET_MIB = {"irse64_rts": (24.0, 112), "default": (16.0, 32)}


@dataclass(frozen=True, slots=True)
class Machine:
    """Usable CUDA devices (0 without a CUDA build or a driver), the CPU cores this process may use, and AMX bf16."""

    gpus: int
    cores: int
    amx_bf16: bool = False


@dataclass(frozen=True, slots=True)
class ServingPlan:
    """Every internal tuning value of one ``facegate serve`` (or one in-process pipeline); a field's default holds
    wherever :func:`make_plan` sets no other value."""

    profile: PlanProfile
    device: str  # "cuda" or "cpu"
    precision: str  # of the recognizer ("fp32", "fp16", "bf16"); the detector is always fp32
    compile: str  # "off", "graphs" or "inductor" on CUDA; "off" or "torchscript" (the frozen recognizer) on the CPU
    workers: int  # front-end processes (1: a single process serves HTTP and runs the engine)
    engines: int  # engine processes in all, engines_per_gpu of them per GPU
    engines_per_gpu: int
    fused_kernels: bool  # Triton kernels for the bias + activation epilogues and YuNet's depthwise convs
    channels_last: bool  # recognizer in NHWC (CUDA at fp16/bf16: tensor cores)
    det_channels_last: bool  # detector in NHWC (on the CPU its depthwise convs run several times faster)
    det_graphs: bool  # the detector runs as CUDA graphs too (when compile is not "off")
    det_max_batch_pixels: int  # largest detector forward, in padded input pixels (rows × height × width)
    photo_stage: str  # "auto", "on" or "off": whether the engine decodes and aligns photos
    cpu_threads: int | None  # intra-op threads of torch, OpenCV and ONNX Runtime; None: the libraries' defaults
    graph_buckets: tuple[int, ...] = (4, 16, 32, 64)  # batch sizes captured as CUDA graphs; batches pad up to the next
    photo_warp_mib: int = 16  # MiB of float32 photos the photo stage warps at once (bounds its peak memory)
    activation_budget_mib: float | None = None  # bound on the recognizer's activations per forward; None: none
    gpu_arena_mib: int | None = None  # one allocator segment reserved before the models load; None: none
    cpu_chunk: int = 4  # on the CPU, the largest sub-batch of one forward (per-face speed falls at large batches)
    cpu_shards: int = 1  # on the CPU, device threads, and threads sharing each batch's rows (1: none)
    decode_workers: int = 4  # threads of a front-end that decode and align uploads
    onnx_cpu: bool = False  # on the CPU, the detector network on ONNX Runtime (exported from facegate's YuNet)
    # seconds of work a front-end admits at once (its completion rate times this): a CPU engine needs about half a
    # second in flight to fill its batches; on a GPU a burst that large holds the front-end's event loop at a
    # flood's start, delaying its refusals, while a tenth of a second keeps the engines full. One process that
    # serves HTTP and runs a GPU engine too (low-memory) admits half a second, as on the CPU: with a tenth, a few
    # clients past its small bound sent refusals fast enough to starve its engine of the GIL
    admission_queue_s: float = 0.5

    def summary(self) -> str:
        """One line for the start-up log: every value of the plan."""
        return "serving plan: " + " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def _cuda_build_present() -> bool:
    """Whether the installed torch is a CUDA build, without importing it (its CUDA library is on disk)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return any(lib.glob("libtorch_cuda*")) or any(lib.glob("torch_cuda*.dll"))


def _driver_gpus() -> int:
    """GPUs the NVIDIA driver shows (``/proc/driver/nvidia/gpus``, else ``nvidia-smi -L``), before
    ``CUDA_VISIBLE_DEVICES``."""
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return sum(1 for _ in proc.iterdir())
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):  # no nvidia-smi (FileNotFoundError), or it hung
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _visible_gpus(visible: str, gpus: int) -> int:
    """How many of ``gpus`` devices ``CUDA_VISIBLE_DEVICES=visible`` leaves: CUDA reads the list up to its first
    invalid entry (not an index below ``gpus`` nor a ``GPU-``/``MIG-`` UUID, or a repeat), so ``0,-1,1`` is one."""
    seen: set[str] = set()
    for entry in (e.strip() for e in visible.split(",")):
        valid = entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < gpus)
        if not valid or entry in seen:
            break
        seen.add(entry)
    return min(gpus, len(seen))


@functools.cache
def detect_machine() -> Machine:
    """GPUs and cores of this machine, without importing torch (cached: it does not change under a process)."""
    gpus = _driver_gpus() if _cuda_build_present() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and gpus:
        gpus = _visible_gpus(visible, gpus)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    cpuinfo = Path("/proc/cpuinfo")  # amx_bf16: the CPU multiplies bf16 matrices in hardware
    return Machine(gpus, cores, cpuinfo.is_file() and " amx_bf16" in cpuinfo.read_text(errors="replace"))


def make_plan(settings: Settings, machine: Machine | None = None) -> ServingPlan:
    """The serving plan for ``settings`` on ``machine`` (this one by default).

    Explicit settings win over the profile: ``precision``, ``compile``, ``workers``, ``engines``,
    ``engines_per_gpu`` and ``gpu_preprocess`` set to anything but their ``auto``/None default are kept.
    """
    m = machine or detect_machine()
    if settings.device != "auto":
        device = settings.device
    else:
        device = "cuda" if m.gpus > 0 and settings.profile != "cpu" else "cpu"
    profile: PlanProfile = "cpu"  # the GPU profiles mean nothing without a GPU
    if device == "cuda":
        profile = "throughput" if settings.profile == "auto" else settings.profile
    gpus = max(m.gpus, 1)
    model = "irse64_rts" if settings.rts_checkpoint is not None else settings.model
    budget, arena = LOW_MEMORY_BUDGET_MIB.get(model, LOW_MEMORY_BUDGET_MIB["default"])

    # the CPU plan (bf16 where AMX runs it, at LFW parity: docs/benchmarks.md); the GPU profiles change what they name
    base: dict[str, Any] = dict(
        precision="bf16" if m.amx_bf16 else "fp32", compile="off", engines_per_gpu=1, engines=1, workers=1,
        fused_kernels=False, det_graphs=False, det_max_batch_pixels=DEFAULT_DET_BATCH_PIXELS, photo_stage="auto",
    )  # fmt: skip
    if profile == "throughput":
        per_gpu = min(ENGINES_PER_GPU, max(1, 16 // gpus)) if m.cores >= 8 else 1
        base.update(
            precision="fp16", compile="graphs", engines_per_gpu=per_gpu, engines=per_gpu * gpus,
            workers=min(64, max(2, m.cores // 2)) if m.cores >= 4 else 1, fused_kernels=True,
            det_graphs=True, det_max_batch_pixels=THROUGHPUT_DET_BATCH_PIXELS,
        )  # fmt: skip
    elif profile == "low-memory":
        base.update(
            precision="fp16", fused_kernels=True, det_max_batch_pixels=LOW_MEMORY_DET_BATCH_PIXELS, photo_stage="off",
            activation_budget_mib=budget, gpu_arena_mib=arena,
        )  # fmt: skip

    explicit = {k: getattr(settings, k) for k in ("precision", "compile", "workers", "engines", "engines_per_gpu")}
    explicit["photo_stage"] = settings.gpu_preprocess
    base.update({k: v for k, v in explicit.items() if v is not None and v != "auto"})
    if settings.engines is not None and settings.engines_per_gpu is None:
        base["engines_per_gpu"] = min(base["engines_per_gpu"], settings.engines)
    if base["engines"] > 1 and base["workers"] < 2 and settings.workers is None:
        base["workers"] = 2
    if device == "cpu":
        base["compile"] = "off" if settings.compile == "off" else "torchscript"
    return ServingPlan(
        profile=profile,
        device=device,
        channels_last=device == "cuda" and base["precision"] != "fp32",
        det_channels_last=device == "cpu",
        cpu_threads=1,
        cpu_shards=m.cores if device == "cpu" else 1,
        onnx_cpu=device == "cpu" and importlib.util.find_spec("onnxruntime") is not None,
        admission_queue_s=0.1 if device == "cuda" and (base["workers"] > 1 or base["engines"] > 1) else 0.5,
        **base,
    )
