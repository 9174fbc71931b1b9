"""HTTP end-to-end benchmark: facegate against a naive service and LitServe, in one run, one JSON.

For each server (``facegate``, ``facegate_nobatch``, ``naive``, ``litserve``; pick with ``--servers``) in
turn: start it as a subprocess on a free loopback port (its own process session), time the cold start up
to the first 200 from ``GET /readyz``, then for every request kind and concurrency run facegate's closed-loop
load generator (:mod:`facegate.bench.http`: ``compare`` = two LFW photos with detection,
``embed_aligned`` = 112×112 aligned crops, ``aligned=true``) for a time-bounded warm-up and ``--duration``
seconds, then stop the server (SIGTERM to its session, SIGKILL after 15 s).

Load comes from ``--client-procs`` client processes (``auto``: one per 32 clients, at most a third of the
CPUs), each running ``concurrency/procs`` closed-loop httpx clients; they start the measured phase together
(a barrier) and their latency samples are merged, so percentiles are over every request. Each row also
records what could limit it: the busiest client process's CPU use (a Python client saturates near 1.0
core), the server's CPU use (all its processes; and its busiest thread, since one Python thread holding
the GIL caps a server near 1.0 core), the machine's CPU busy share, and, with CUDA, GPU utilisation sampled
every 100 ms (pynvml, else ``nvidia-smi``). ``limits`` lists the flags that fired.

With CUDA it also records each server's GPU memory from the driver (``nvidia-smi --query-compute-apps``
equivalent, summed over the server's processes, at idle after warm-up and after load) next to a bare
``torch.cuda.init()`` + one-element tensor process measured in the same run, and facegate's own torch
numbers (``facegate_gpu_memory_bytes`` from ``/metrics``: allocated, reserved, peak) and its mean batch size
per stage for every row. The parent never touches CUDA until the very end (``env_record``).

The image pool: ``--n-images`` photos spread evenly over the (sorted) files under ``--images`` (LFW layout;
default ``$FACEGATE_LFW_ROOT/lfw-deepfunneled``), kept only where facegate's detector finds a face (so every
server answers 200); the aligned crops are the largest face of each, aligned once with the pipeline's
own alignment on the CPU and encoded as JPEG (quality 95; ``--crop-format png`` for lossless).

CPU (issue 3; a 2-core box, short):
  python benchmarks/http_e2e.py --device cpu --servers facegate,facegate_nobatch,naive \
      --concurrency 1,8,32 --duration 10 --out benchmarks/results/http_cpu.json
GPU (issue 4, < 5 minutes):
  python benchmarks/http_e2e.py --device cuda --precision fp16 --compile graphs \
      --concurrency 1,16,100,256 --duration 5 --out benchmarks/results/http_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.bench.http import _phase, _RequestMaker, collect_images

log = logging.getLogger("http_e2e")

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(__file__).resolve().parent / "peers"
SERVER_NAMES = ("facegate", "facegate_nobatch", "naive", "litserve")
KIND_CHOICES = ("compare", "embed_aligned")
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: CPU share (of one core) above which a single-threaded client process or server thread counts as the limit
SATURATED = 0.85


# --------------------------------------------------------------------------- image pool
def prepare_images(
    root: Path, n: int, crop_format: str = "jpg"
) -> tuple[list[tuple[str, bytes, str]], list[tuple[str, bytes, str]]]:
    """``n`` photos spread over ``root`` with a detectable face, and the aligned crop of each.

    Returns ``(photos, crops)`` as ``[(file name, encoded bytes, MIME type)]``; crops are ``112×112`` RGB
    encoded as JPEG (q 95) or PNG. Runs on the CPU (the parent must not create a CUDA context).
    """
    import cv2
    import torch

    from facegate.io.decode import decode_image
    from facegate.models.yunet import FaceDetector, load_yunet
    from facegate.pipeline.pipeline import FacePipeline, select_faces

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    files = collect_images([root])
    step = max(1, len(files) // max(1, n))
    chosen = files[::step][: n + n // 4]  # a few spare for photos without a face
    detector = FaceDetector(load_yunet(), device="cpu")
    photos: list[tuple[str, bytes, str]] = []
    crops: list[tuple[str, bytes, str]] = []
    for start in range(0, len(chosen), 32):
        chunk = chosen[start : start + 32]
        datas = [p.read_bytes() for p in chunk]
        images = [decode_image(d, max_bytes=20 << 20, max_pixels=40_000_000) for d in datas]
        for path, data, img, dets in zip(chunk, datas, images, detector.detect(images), strict=True):
            if not dets or len(photos) >= n:
                continue
            det = select_faces(dets)[0]
            crop = FacePipeline.align([img], [det], [0])[0]
            ext = ".png" if crop_format == "png" else ".jpg"
            params = [] if crop_format == "png" else [cv2.IMWRITE_JPEG_QUALITY, 95]
            ok, buf = cv2.imencode(ext, np.ascontiguousarray(crop[:, :, ::-1]), params)
            if not ok:
                continue
            mime = "image/png" if crop_format == "png" else "image/jpeg"
            photos.append((path.name, data, "image/jpeg"))
            crops.append((path.stem + "_crop" + ext, buf.tobytes(), mime))
    if len(photos) < 2:
        raise SystemExit(f"fewer than 2 photos with a face under {root}")
    return photos, crops


# --------------------------------------------------------------------------- /proc helpers
def _stat_fields(path: str) -> list[str] | None:
    try:
        with open(path) as fh:
            raw = fh.read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()  # fields from 'state' (field 3) on


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a server started with ``start_new_session=True``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(f"/proc/{entry}/stat")
            if f is not None and int(f[3]) == sid and f[0] != "Z":
                out.append(int(entry))
    return out


def thread_ticks(pids: list[int]) -> dict[tuple[int, int], int]:
    """CPU ticks (user + system) of every thread of ``pids``."""
    out: dict[tuple[int, int], int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                f = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
                if f is not None:
                    out[(pid, int(tid))] = int(f[11]) + int(f[12])
    return out


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as fh:
        vals = [int(v) for v in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


# --------------------------------------------------------------------------- GPU
class GpuMonitor:
    """Background sampler of one GPU's utilisation and memory (pynvml, else nvidia-smi)."""

    def __init__(self, index: int = 0, period_s: float = 0.1) -> None:
        self.index, self.period_s = index, period_s
        self.samples: list[tuple[float, float, float]] = []  # (t, util %, used MiB)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nvml: Any = None
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
            self.backend = "pynvml"
        except Exception:
            self.backend = "nvidia-smi" if shutil.which("nvidia-smi") else "none"

    @property
    def available(self) -> bool:
        return self.backend != "none"

    def name(self) -> str | None:
        if self.nvml is not None:
            n = self.nvml.nvmlDeviceGetName(self.handle)
            return n.decode() if isinstance(n, bytes) else str(n)
        return self._smi(["--query-gpu=name"])[0][0] if self.backend == "nvidia-smi" else None

    def _smi(self, query: list[str]) -> list[list[str]]:
        res = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits", "-i", str(self.index)],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return [[c.strip() for c in line.split(",")] for line in res.stdout.strip().splitlines() if line.strip()]

    def read(self) -> tuple[float, float]:
        """(utilisation %, used MiB) now."""
        if self.nvml is not None:
            u = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
            m = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            return float(u.gpu), m.used / 2**20
        row = self._smi(["--query-gpu=utilization.gpu,memory.used"])[0]
        return float(row[0]), float(row[1])

    def processes(self) -> dict[int, float]:
        """``{pid: used MiB}`` of the compute processes on this GPU."""
        if self.nvml is not None:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
            return {int(p.pid): (p.usedGpuMemory or 0) / 2**20 for p in procs}
        rows = self._smi(["--query-compute-apps=pid,used_memory"])
        return {int(r[0]): float(r[1]) for r in rows if len(r) == 2 and r[0].isdigit()}

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                u, m = self.read()
                self.samples.append((time.perf_counter(), u, m))
            self._stop.wait(self.period_s if self.nvml is not None else max(self.period_s, 0.2))

    def start(self) -> None:
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return {"gpu_util_mean": None, "gpu_util_max": None, "gpu_mem_used_max_mib": None, "gpu_samples": 0}
        u = np.array([x[1] for x in s])
        return {
            "gpu_util_mean": round(float(u.mean()), 1),
            "gpu_util_max": round(float(u.max()), 1),
            "gpu_mem_used_max_mib": round(max(x[2] for x in s), 1),
            "gpu_samples": len(s),
        }


def gpu_index() -> int:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def process_gpu_mib(gpu: GpuMonitor, pids: list[int]) -> dict[str, Any]:
    """Driver-reported GPU memory of ``pids`` (summed) and every compute process seen."""
    try:
        procs = gpu.processes()
    except Exception as exc:
        return {"error": repr(exc)}
    mine = {p: round(v, 1) for p, v in procs.items() if p in set(pids)}
    return {"mib": round(sum(mine.values()), 1) if mine else None, "by_pid": mine, "all_pids": procs}


def bare_context_mib(gpu: GpuMonitor) -> dict[str, Any]:
    """GPU memory of a process that only does ``torch.cuda.init()`` and allocates one element."""
    code = (
        "import sys, torch; torch.cuda.init(); x = torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    used0 = gpu.read()[1]
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            return {"error": f"bare context process said {line!r}"}
        time.sleep(1.0)
        out = process_gpu_mib(gpu, [proc.pid])
        out["device_used_delta_mib"] = round(gpu.read()[1] - used0, 1)
        out["what"] = "torch.cuda.init(); torch.zeros(1, device='cuda')"
        return out
    finally:
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


# --------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_argv(name: str, port: int, o: argparse.Namespace, data_dir: Path) -> list[str]:
    """Command line of server ``name`` on ``port``."""
    py = sys.executable
    dev = o.device
    if name in ("facegate", "facegate_nobatch"):
        argv = [py, "-m", "facegate", "serve", "--host", "127.0.0.1", "--port", str(port), "--device", dev]
        argv += ["--precision", o.precision, "--compile", o.compile, "--data-dir", str(data_dir)]
        argv += ["--max-batch-size", str(o.max_batch_size)]
        if o.max_wait_ms is not None:
            argv += ["--max-wait-ms", str(o.max_wait_ms)]
        return [*argv, "--batching" if name == "facegate" else "--no-batching"]
    if name == "naive":
        return [py, str(PEERS / "naive_server.py"), "--port", str(port), "--device", dev]
    if name == "litserve":
        argv = [
            py,
            str(PEERS / "litserve_server.py"),
            "--port",
            str(port),
            "--device",
            "cuda" if dev == "cuda" else "cpu",
        ]
        argv += ["--precision", o.peer_precision or o.precision, "--compile", o.peer_compile]
        argv += ["--max-batch-size", "64", "--batch-timeout-ms", str(o.litserve_batch_timeout_ms)]
        if o.litserve_fast_queue:
            argv.append("--fast-queue")
        if o.litserve_api_servers:
            argv += ["--api-servers", str(o.litserve_api_servers)]
        return argv
    raise SystemExit(f"unknown server {name!r}; choose from {SERVER_NAMES}")


@dataclass
class Server:
    """A server subprocess in its own session, with its log file."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    t_start: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, FACEGATE_LOG_LEVEL=os.environ.get("FACEGATE_LOG_LEVEL", "WARNING"))
        env["PYTHONUNBUFFERED"] = "1"
        self.t_start = time.perf_counter()
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from start to the first 200 of ``/readyz``; raises RuntimeError on exit/timeout."""
        assert self.proc is not None
        deadline = self.t_start + timeout_s
        with httpx.Client(timeout=2.0) as c:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if c.get(self.url + "/readyz").status_code == 200:
                        return time.perf_counter() - self.t_start
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def pids(self) -> list[int]:
        return session_pids(self.proc.pid) if self.proc is not None else []

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop on SIGTERM; killing its session", self.name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # LitServe's workers can outlive the leader
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def log_tail(self, n: int = 1500) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""


def scrape_facegate(url: str) -> dict[str, Any]:
    """facegate's batch-size sums/counts per stage and torch GPU memory from ``/metrics``."""
    out: dict[str, Any] = {"batch": {}, "gpu_memory_mib": {}}
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return out
    for m in re.finditer(r'^facegate_batch_size_(sum|count)\{stage="(\w+)"\} ([0-9.e+-]+)', text, re.M):
        out["batch"].setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    for m in re.finditer(r'^facegate_gpu_memory_bytes\{kind="(\w+)"\} ([0-9.e+-]+)', text, re.M):
        out["gpu_memory_mib"][m.group(1)] = round(float(m.group(2)) / 2**20, 1)
    return out


def mean_batch(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    res = {}
    for stage, a in after.get("batch", {}).items():
        b = before.get("batch", {}).get(stage, {})
        dc = a.get("count", 0.0) - b.get("count", 0.0)
        if dc > 0:
            res[stage] = round((a.get("sum", 0.0) - b.get("sum", 0.0)) / dc, 2)
    return res


# --------------------------------------------------------------------------- load clients
def _client_main(spec: dict[str, Any], barrier: Any, out_q: Any) -> None:
    """One client process: warm-up, barrier, measured phase; puts its raw samples on ``out_q``."""
    try:
        out_q.put(asyncio.run(_client_async(spec, barrier)))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            barrier.abort()
        out_q.put({"proc": spec["proc"], "error": f"{type(exc).__name__}: {exc}"})


async def _client_async(spec: dict[str, Any], barrier: Any) -> dict[str, Any]:
    c = spec["concurrency"]
    make = _RequestMaker(spec["kind"], spec["pool"], spec["images_per_request"], False)
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    timeout = httpx.Timeout(spec["timeout_s"], connect=10.0)
    async with httpx.AsyncClient(base_url=spec["url"], limits=limits, timeout=timeout) as client:
        offset = spec["offset"]
        if spec["warmup_s"] > 0:
            await _phase(
                client,
                make,
                concurrency=c,
                n_requests=None,
                duration_s=spec["warmup_s"],
                start_index=offset,
                progress=None,
            )
        barrier.wait(timeout=spec["barrier_timeout_s"])  # nothing else runs on this loop now
        cpu0 = time.process_time()
        rec = await _phase(
            client,
            make,
            concurrency=c,
            n_requests=None,
            duration_s=spec["duration_s"],
            start_index=offset + 7_919,
            progress=None,
        )
        cpu = time.process_time() - cpu0
    return {
        "proc": spec["proc"],
        "concurrency": c,
        "latencies_s": rec.latencies_s,
        "errors": dict(rec.errors),
        "item_errors": dict(rec.item_errors),
        "n": rec.n,
        "first_send": rec.first_send,
        "last_done": rec.last_done,
        "cpu_s": cpu,
    }


def auto_client_procs(concurrency: int) -> int:
    """One process per 32 clients, at most a third of the CPUs (the server needs the rest)."""
    return max(1, min(math.ceil(concurrency / 32), (os.cpu_count() or 1) // 3, concurrency))


def run_point(
    server: Server,
    *,
    kind: str,
    pool: list[tuple[str, bytes, str]],
    concurrency: int,
    o: argparse.Namespace,
    gpu: GpuMonitor | None,
) -> dict[str, Any]:
    """One (server, kind, concurrency) measurement with merged client samples and limit diagnostics."""
    procs_n = auto_client_procs(concurrency) if o.client_procs == "auto" else min(int(o.client_procs), concurrency)
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    barrier = ctx.Barrier(procs_n + 1)
    out_q = ctx.Queue()
    k = o.images_per_request if kind == "embed_aligned" else 1
    procs = []
    for i in range(procs_n):
        spec = {
            "proc": i,
            "url": server.url,
            "kind": kind,
            "pool": pool,
            "images_per_request": k,
            "concurrency": concurrency // procs_n + (1 if i < concurrency % procs_n else 0),
            "warmup_s": o.warmup,
            "duration_s": o.duration,
            "timeout_s": o.timeout,
            "offset": i * 104_729,
            "barrier_timeout_s": o.warmup + o.timeout + 60,
        }
        p = ctx.Process(target=_client_main, args=(spec, barrier, out_q), daemon=True)
        p.start()
        procs.append(p)
    is_fg = server.name.startswith("facegate")
    load0 = os.getloadavg()
    with contextlib.suppress(threading.BrokenBarrierError):  # a failed client reports through the queue
        barrier.wait(timeout=o.warmup + o.timeout + 60)
    metrics0 = scrape_facegate(server.url) if is_fg else {}
    pids = server.pids()
    th0, m0, t0 = thread_ticks(pids), machine_ticks(), time.perf_counter()
    results = [out_q.get(timeout=o.duration + o.warmup + o.timeout + 120) for _ in procs]
    t1, th1, m1 = time.perf_counter(), thread_ticks(pids), machine_ticks()
    metrics1 = scrape_facegate(server.url) if is_fg else {}
    for p in procs:
        p.join(timeout=10)
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(f"client process failed: {failed[0]}")

    lat = np.concatenate([np.asarray(r["latencies_s"], np.float64) for r in results]) * 1000.0
    n = sum(r["n"] for r in results)
    firsts = [r["first_send"] for r in results if r["first_send"] is not None]
    elapsed = max(r["last_done"] for r in results) - min(firsts) if firsts else 0.0
    errors: dict[str, int] = {}
    item_errors: dict[str, int] = {}
    for r in results:
        for key, v in r["errors"].items():
            errors[key] = errors.get(key, 0) + v
        for key, v in r["item_errors"].items():
            item_errors[key] = item_errors.get(key, 0) + v
    client_cpu = [
        round(r["cpu_s"] / max(r["last_done"] - (r["first_send"] or r["last_done"]), 1e-9), 2) for r in results
    ]
    wall = max(t1 - t0, 1e-9)
    deltas = {key: th1[key] - th0.get(key, 0) for key in th1}
    server_cores = sum(deltas.values()) / CLK_TCK / wall
    top_thread = max(deltas.values(), default=0) / CLK_TCK / wall
    machine_busy = (m1[0] - m0[0]) / max(m1[1] - m0[1], 1)
    per_req = 2 if kind == "compare" else k
    n_ok = int(lat.size)

    def pct(q: float) -> float | None:
        return round(float(np.percentile(lat, q)), 2) if n_ok else None

    row: dict[str, Any] = {
        "server": server.name,
        "kind": kind,
        "concurrency": concurrency,
        "images_per_request": per_req,
        "n": n,
        "n_ok": n_ok,
        "elapsed_s": round(elapsed, 3),
        "req_s": round(n / elapsed, 2) if elapsed else 0.0,
        "ok_req_s": round(n_ok / elapsed, 2) if elapsed else 0.0,
        "images_s": round(n_ok * per_req / elapsed, 2) if elapsed else 0.0,
        "p50_ms": pct(50),
        "p95_ms": pct(95),
        "p99_ms": pct(99),
        "mean_ms": round(float(lat.mean()), 2) if n_ok else None,
        "max_ms": round(float(lat.max()), 2) if n_ok else None,
        "errors": errors,
        "item_errors": item_errors,
        "client_procs": procs_n,
        "client_cpu_per_proc": client_cpu,
        "server_cpu_cores": round(server_cores, 2),
        "server_top_thread_cpu": round(top_thread, 2),
        "server_processes": len(pids),
        "machine_cpu_busy": round(machine_busy, 3),
        "loadavg_1m": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
    }
    if is_fg:
        row["mean_batch_size"] = mean_batch(metrics0, metrics1)
    if gpu is not None and gpu.available:
        row.update(gpu.window(t0, t1))
    row["limits"] = limits_of(row)
    return row


def limits_of(row: dict[str, Any]) -> list[str]:
    """Which resource plausibly capped this row (heuristic flags; see the module docstring)."""
    out = []
    if max(row["client_cpu_per_proc"], default=0) >= SATURATED:
        out.append("client_cpu")
    if row["server_top_thread_cpu"] >= SATURATED:
        out.append("server_thread_cpu")
    if row["machine_cpu_busy"] >= 0.9:
        out.append("machine_cpu")
    if (row.get("gpu_util_mean") or 0) >= 85:
        out.append("gpu")
    return out


# --------------------------------------------------------------------------- driver
def run_server(
    name: str,
    o: argparse.Namespace,
    pools: dict[str, list[tuple[str, bytes, str]]],
    workdir: Path,
    gpu: GpuMonitor | None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start one server, measure every kind × concurrency, stop it. Returns (server info, rows)."""
    port = free_port()
    data_dir = workdir / f"data_{name}"
    data_dir.mkdir(exist_ok=True)
    srv = Server(name, server_argv(name, port, o, data_dir), port, workdir / f"{name}.log")
    info: dict[str, Any] = {"argv": [Path(a).name if a == sys.executable else a for a in srv.argv]}
    rows: list[dict[str, Any]] = []
    used0 = gpu.read()[1] if gpu is not None and gpu.available else None
    log.info("starting %s: %s", name, " ".join(srv.argv))
    srv.start()
    try:
        info["cold_start_s"] = round(srv.wait_ready(o.ready_timeout), 2)
        log.info("%s ready in %.1f s", name, info["cold_start_s"])
        if gpu is not None and gpu.available:
            time.sleep(0.5)
            info["gpu_memory_idle"] = process_gpu_mib(gpu, srv.pids())
            info["gpu_memory_idle"]["device_used_delta_mib"] = round(gpu.read()[1] - (used0 or 0.0), 1)
        if name.startswith("facegate"):
            info["torch_memory_idle_mib"] = scrape_facegate(srv.url)["gpu_memory_mib"]
        for kind in o.kinds:
            for c in o.concurrency:
                row = run_point(srv, kind=kind, pool=pools[kind], concurrency=c, o=o, gpu=gpu)
                rows.append(row)
                log.info(
                    "%-16s %-13s c=%-4d %8.1f req/s %8.1f img/s  p50 %s p99 %s ms  err %s  limits %s",
                    name, kind, c, row["ok_req_s"], row["images_s"], row["p50_ms"], row["p99_ms"],
                    row["errors"] or "-", row["limits"] or "-",
                )  # fmt: skip
        if gpu is not None and gpu.available:
            info["gpu_memory_after_load"] = process_gpu_mib(gpu, srv.pids())
            info["gpu_memory_after_load"]["device_used_delta_mib"] = round(gpu.read()[1] - (used0 or 0.0), 1)
        if name.startswith("facegate"):
            info["torch_memory_after_load_mib"] = scrape_facegate(srv.url)["gpu_memory_mib"]
    except Exception as exc:
        log.error("%s failed: %s", name, exc)
        info["error"] = str(exc)[-2000:]
    finally:
        srv.stop()
    return info, rows


def ratios(rows: list[dict[str, Any]], base: str = "facegate") -> dict[str, dict[str, dict[str, float | None]]]:
    """``{"facegate/<other>": {kind: {concurrency: ok_req_s ratio}}}`` for every other server present."""
    by = {(r["server"], r["kind"], r["concurrency"]): r for r in rows}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for other in sorted({r["server"] for r in rows} - {base}):
        table: dict[str, dict[str, float | None]] = {}
        for (srv, kind, c), r in sorted(by.items()):
            if srv != base:
                continue
            o = by.get((other, kind, c))
            val = round(r["ok_req_s"] / o["ok_req_s"], 2) if o and o["ok_req_s"] else None
            table.setdefault(kind, {})[str(c)] = val
        out[f"{base}/{other}"] = table
    return out


def markdown(result: dict[str, Any]) -> str:
    """A summary table per request kind: req/s and p50/p99 per server, and facegate's ratios."""
    rows = result["rows"]
    servers = [s for s in SERVER_NAMES if any(r["server"] == s for r in rows)]
    lines = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        lines.append(f"\n**{kind}** (req/s; p50 / p99 ms)\n")
        ratio_keys = [k for k in result["ratios"] if kind in result["ratios"][k]]
        head = ["concurrency", *servers, *ratio_keys]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for c in dict.fromkeys(r["concurrency"] for r in rows if r["kind"] == kind):
            cells = [str(c)]
            for s in servers:
                r = next((x for x in rows if x["server"] == s and x["kind"] == kind and x["concurrency"] == c), None)
                if r is None:
                    cells.append("–")
                else:
                    err = f", {sum(r['errors'].values())} err" if r["errors"] else ""
                    cells.append(f"{r['ok_req_s']:.1f} ({r['p50_ms']} / {r['p99_ms']}{err})")
            cells += [
                "–" if result["ratios"][k][kind].get(str(c)) is None else f"{result['ratios'][k][kind][str(c)]:.2f}×"
                for k in ratio_keys
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"], help="facegate's precision")
    p.add_argument("--compile", default="off", choices=["off", "graphs", "inductor"], help="facegate's compile mode")
    p.add_argument("--peer-precision", default=None, help="LitServe's precision (default: --precision)")
    p.add_argument("--peer-compile", default="off", choices=["off", "graphs", "inductor"], help="LitServe's")
    p.add_argument("--max-batch-size", type=int, default=64, help="facegate's engine batch size")
    p.add_argument("--max-wait-ms", type=float, default=None, help="facegate's batch fill wait (default: config)")
    p.add_argument("--images", type=Path, default=None, help="folder of LFW-layout photos")
    p.add_argument("--n-images", type=int, default=256)
    p.add_argument("--crop-format", default="jpg", choices=["jpg", "png"])
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated list")
    p.add_argument("--kinds", default=",".join(KIND_CHOICES), help="compare,embed_aligned")
    p.add_argument("--servers", default="facegate,naive,litserve", help=f"subset of {','.join(SERVER_NAMES)}")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.5, help="unrecorded seconds per point")
    p.add_argument("--images-per-request", type=int, default=1, help="images per embed_aligned request")
    p.add_argument("--client-procs", default="auto", help="'auto' or a number of client processes")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request client timeout")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--litserve-batch-timeout-ms", type=float, default=3.0)
    p.add_argument("--litserve-fast-queue", action="store_true", help="LitServe's ZMQ transport")
    p.add_argument("--litserve-api-servers", type=int, default=None)
    p.add_argument("--no-bare-context", dest="bare_context", action="store_false")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/http_e2e.json"))
    o = p.parse_args(argv)
    o.concurrency = [int(x) for x in str(o.concurrency).split(",") if x.strip()]
    o.kinds = [k.strip() for k in o.kinds.split(",") if k.strip()]
    o.servers = [s.strip() for s in o.servers.split(",") if s.strip()]
    for k in o.kinds:
        if k not in KIND_CHOICES:
            p.error(f"unknown kind {k!r}")
    for s in o.servers:
        if s not in SERVER_NAMES:
            p.error(f"unknown server {s!r}")
    return o


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    o = parse_args(argv)
    gpu = GpuMonitor(gpu_index()) if o.device in ("auto", "cuda") else None
    if gpu is not None and not gpu.available:
        gpu = None
    if o.device == "auto":
        o.device = "cuda" if gpu is not None else "cpu"
    if o.images is None:
        lfw = os.environ.get("FACEGATE_LFW_ROOT")
        if not lfw:
            raise SystemExit("give --images DIR or set FACEGATE_LFW_ROOT")
        o.images = Path(lfw) / "lfw-deepfunneled"
    t_all = time.perf_counter()
    photos, crops = prepare_images(o.images, o.n_images, o.crop_format)
    log.info("image pool: %d photos, %d crops (%.1f s)", len(photos), len(crops), time.perf_counter() - t_all)
    pools = {"compare": photos, "embed_aligned": crops}
    result: dict[str, Any] = {"benchmark": "http_e2e", "command": " ".join(["python", *sys.argv]), "servers": {}}
    if gpu is not None:
        gpu.start()
        if o.bare_context:
            result["bare_cuda_context"] = bare_context_mib(gpu)
            log.info("bare CUDA context: %s", result["bare_cuda_context"])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="http_e2e_") as tmp:
        for name in o.servers:
            info, srows = run_server(name, o, pools, Path(tmp), gpu)
            result["servers"][name] = info
            rows.extend(srows)
    if gpu is not None:
        gpu.stop()
    result["rows"] = rows
    result["ratios"] = ratios(rows)
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(o).items()}
    config.update(n_photos=len(photos), n_crops=len(crops), gpu_monitor=None if gpu is None else gpu.backend)
    config["photo_bytes_mean"] = round(sum(len(p[1]) for p in photos) / len(photos))
    config["crop_bytes_mean"] = round(sum(len(c[1]) for c in crops) / len(crops))
    result["env"] = env_record(**config)  # touches CUDA (device name): only now, after every measurement
    result["table_md"] = markdown(result)
    write_json(o.out, result)
    print(result["table_md"])  # CLI output
    log.info("wrote %s in %.0f s", o.out, result["total_s"])
    return 0 if rows and not any("error" in s for s in result["servers"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
