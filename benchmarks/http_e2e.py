"""HTTP end-to-end benchmark: facegate against a naive service and LitServe, in one run, one JSON.

Servers (``--servers``; ``server_variants.py`` lists the names and the setting each one changes: facegate
variants, ``naive``, ``litserve``) start one by one as subprocesses on free loopback ports, each in its own session
(cold start = time to the first 200 from ``/readyz``), and stay up, SIGSTOPped while idle (an idle LitServe polls
its queues). Points go round-robin over them: per concurrency (in the order given), per kind (``compare``: two
LFW photos with detection;
``embed_aligned``: one 112×112 aligned crop, ``aligned=true``; ``embed_aligned_batch``: ``--batch-images`` crops
in one request, as a batch-embedding client sends them; ``search``: one LFW photo, detection included, against
a facegate gallery of ``--gallery-size`` synthetic unit-norm templates (imported in bulk into the server's
store before it starts) plus some LFW identities enrolled through the API, top-10; ``enrol``: ``--enrol-photos``
LFW photos per ``POST …/enrolments`` request, one new subject per photo), facegate's closed-loop load generator
(`loadgen.py`) runs ``--warmup`` unrecorded and ``--duration`` measured seconds, ``--rounds``
times, so other tenants' load hits every server alike. req/s is the median over rounds; percentiles cover
every request. The JSON is rewritten after every point (``complete`` false until the end); SIGTERM (an
outer ``timeout``) stops the servers and keeps the results; ``--budget-s`` starts no point ending past it.

Load: ``--client-procs`` processes (``auto``: see :func:`auto_client_procs`) of
``concurrency/procs`` clients each (``--transport``: the lean ``rawhttp.py`` client, or httpx),
released together by a barrier; latency samples are merged.
``limits`` flags what plausibly capped a row: a client process near 1 core, the server's busiest thread
near 1 core (GIL), the machine's CPU, or GPU utilisation (NVML, every 100 ms) ≥ 85 %.
``ok_req_per_server_cpu_s`` (req/s per server CPU core used) stays comparable when other tenants take CPU;
facegate rows add the mean batch size per stage; multi-process facegate rows add the cores used per role
(engine, front-end, supervisor: ``monitor.process_roles``), the role of the busiest thread, and per round
each front-end's cores, share of the requests and mean in-server latency (how evenly they share the work).
With CUDA: each server's driver-reported GPU memory
(its processes, idle and after load) next to a bare ``torch.cuda.init()`` process measured in the same run,
and facegate's torch allocated/reserved/peak from ``/metrics``; the parent touches CUDA only at the end.
Images: ``--n-images`` photos spread over ``--images`` (LFW layout; default
``$FACEGATE_LFW_ROOT/lfw-deepfunneled``) where the detector finds a face; crops: the largest face of each,
aligned once on the CPU by the pipeline's alignment, JPEG q95 (``--crop-format png``: lossless).

CPU (a 2-core box, short):
  python benchmarks/http_e2e.py --device cpu --servers facegate_default,facegate,naive --concurrency 1,8,32 \
      --duration 5 --rounds 2 --warmup 2 --server-env OMP_WAIT_POLICY=PASSIVE \
      --out benchmarks/results/http_e2e-cpu2.json
GPU (< 10 minutes; the important concurrencies first, so a budget cut drops the last):
  python benchmarks/http_e2e.py --device cuda --precision fp16 --compile graphs --peer-compile graphs \
      --servers facegate_default,facegate_mp_w8_e3_det64,naive,litserve --concurrency 100,256 --duration 4 \
      --budget-s 420 --images DIR --out benchmarks/results/http_e2e-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from loadgen import (
    ERROR_SAMPLES,
    TRANSPORTS,
    ImageItem,
    _phase,
    _RequestMaker,
    client_description,
    open_sender,
)
from monitor import (
    GpuMonitor,
    bare_context_mib,
    cpu_by_role,
    front_end_spread,
    gpu_index,
    machine_ticks,
    mean_batch,
    process_gpu_mib,
    scrape_facegate,
    session_pids,
    thread_ticks,
    time_breakdown,
)
from rawhttp import encode_multipart, encode_request
from server_variants import engines_of, front_ends_of, is_known, profile_of, ray_ingresses, server_env, untuned

log = logging.getLogger("http_e2e")

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(__file__).resolve().parent / "peers"
KIND_CHOICES = ("compare", "embed_aligned", "embed_aligned_batch", "search", "enrol")
GALLERY_KINDS = {"search", "enrol"}
#: galleries a facegate server gets when a gallery kind is measured: searched, and enrolled into
SEARCH_GALLERY, ENROL_GALLERY = "bench", "bench_enrol"
DEFAULT_KINDS = "compare,embed_aligned"


def merge_error_samples(parts: Any) -> dict[str, list[str]]:
    """Several recorders' ``error_samples`` as one (at most :data:`ERROR_SAMPLES` per kind)."""
    out: dict[str, list[str]] = {}
    for part in parts:
        for key, bodies in part.items():
            kept = out.setdefault(key, [])
            kept += bodies[: ERROR_SAMPLES - len(kept)]
    return out


def images_per_request(kind: str, o: argparse.Namespace) -> int:
    """Images in one request of ``kind``: 2 photos (compare), ``--images-per-request`` crops (embed_aligned) or
    ``--batch-images`` crops (embed_aligned_batch), one photo (search) or ``--enrol-photos`` photos (enrol)."""
    return {"compare": 2, "embed_aligned": o.images_per_request, "embed_aligned_batch": o.batch_images, "search": 1,
            "enrol": o.enrol_photos}[kind]  # fmt: skip


class GalleryRequests(_RequestMaker):
    """The gallery kinds' requests: ``search`` (photo ``i`` of the pool, top-10, against :data:`SEARCH_GALLERY`)
    and ``enrol`` (``k`` photos into :data:`ENROL_GALLERY`, one new subject per photo: never cached, since every
    request enrols new ids)."""

    def __call__(self, i: int) -> dict[str, Any]:
        n = len(self.pool)
        if self.kind == "search":
            return {"url": f"/api/galleries/{SEARCH_GALLERY}/search", "files": [("image", self.pool[i % n])],
                    "params": {"k": "10"}}  # fmt: skip
        files = [("images", self.pool[(i * self.k + j) % n]) for j in range(self.k)]
        ids = json.dumps([f"r{i}-{j}" for j in range(self.k)])
        return {"url": f"/api/galleries/{ENROL_GALLERY}/enrolments", "files": files, "data": {"subject_ids": ids}}

    def encoded(self, i: int, host: str) -> bytes:
        if self.kind == "search":
            return super().encoded(i % len(self.pool), host)
        kw = self(i)
        body, ctype = encode_multipart(kw["data"], kw["files"])
        return encode_request("POST", host, kw["url"], body=body, content_type=ctype)


def request_maker(kind: str, pool: list[ImageItem], k: int) -> _RequestMaker:
    if kind in GALLERY_KINDS:
        return GalleryRequests(kind, pool, k, False)  # type: ignore[arg-type]
    return _RequestMaker(kind, pool, k, False)  # type: ignore[arg-type]


def identity(item: ImageItem) -> str:
    """An LFW photo's person (``Aaron_Peirsol_0001.jpg`` → ``Aaron_Peirsol``)."""
    return item[0].rsplit("_", 1)[0]


def prefill_gallery(path: Path, o: argparse.Namespace) -> dict[str, Any]:
    """Create the two benchmark galleries in the store at ``path`` and bulk-import ``--gallery-size``
    synthetic unit-norm templates into :data:`SEARCH_GALLERY` (the store's own template import, 10,000 a
    transaction, as ``facegate enrol templates.npz`` does)."""
    from facegate.gallery import open_store

    store = open_store(str(path))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    try:
        for name in (SEARCH_GALLERY, ENROL_GALLERY):
            store.create_gallery(name, o.gallery_model, o.gallery_dim)
        for s in range(0, o.gallery_size, 10_000):
            m = min(10_000, o.gallery_size - s)
            t = rng.standard_normal((m, o.gallery_dim), dtype=np.float32)
            t /= np.linalg.norm(t, axis=1, keepdims=True)
            store.import_templates(SEARCH_GALLERY, [f"syn{x}" for x in range(s, s + m)], t, np.ones(m, np.float32))
    finally:
        store.close()
    return {"synthetic_templates": o.gallery_size, "import_s": round(time.perf_counter() - t0, 2)}


def enrol_identities(url: str, photos: list[ImageItem], n: int) -> dict[str, Any]:
    """Enrol the first photo of up to ``n`` pool identities that have two or more, through the batch endpoint,
    then search with each one's second photo: the rank-1 identification rate shows the search path is right."""
    by: dict[str, list[ImageItem]] = {}
    for item in photos:
        by.setdefault(identity(item), []).append(item)
    pairs = [(name, items[0], items[1]) for name, items in by.items() if len(items) >= 2][:n]
    enrolled, rank1 = 0, 0
    with httpx.Client(base_url=url, timeout=60.0) as c:
        for s in range(0, len(pairs), 16):
            chunk = pairs[s : s + 16]
            r = c.post(f"/api/galleries/{SEARCH_GALLERY}/enrolments", files=[("images", p[1]) for p in chunk],
                       data={"subject_ids": json.dumps([p[0] for p in chunk])})  # fmt: skip
            r.raise_for_status()
            enrolled += len(r.json()["enrolled"])
        for name, _, probe in pairs:
            r = c.post(f"/api/galleries/{SEARCH_GALLERY}/search", files=[("image", probe)], params={"k": "10"})
            hits = r.json().get("hits", []) if r.status_code == 200 else []
            rank1 += bool(hits) and hits[0]["subject_id"] == name
        subjects = c.get(f"/api/galleries/{SEARCH_GALLERY}/subjects", params={"limit": 1}).json()["total"]
    return {"lfw_identities_enrolled": enrolled, "lfw_probes": len(pairs), "lfw_rank1": rank1, "subjects": subjects}


def gallery_subjects(url: str, name: str) -> int:
    with httpx.Client(base_url=url, timeout=30.0) as c:
        return int(c.get(f"/api/galleries/{name}/subjects", params={"limit": 1}).json()["total"])


CLK_TCK = os.sysconf("SC_CLK_TCK")
#: CPU share (of one core) above which a single-threaded client process or server thread counts as the limit
SATURATED = 0.85


def prepare_images(root: Path, n: int, crop_format: str = "jpg") -> tuple[list[ImageItem], list[ImageItem]]:
    """``n`` photos with a face under ``root`` and their aligned crops, as ``[(name, bytes, MIME type)]``.

    Runs on the CPU (the parent must not create a CUDA context); crops are encoded JPEG q95 or PNG.
    """
    import cv2
    import torch

    from cpu_models import lfw_faces

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    ext, mime = (".png", "image/png") if crop_format == "png" else (".jpg", "image/jpeg")
    params = [] if crop_format == "png" else [cv2.IMWRITE_JPEG_QUALITY, 95]
    photos: list[ImageItem] = []
    crops: list[ImageItem] = []
    for f in lfw_faces(root, n):
        ok, buf = cv2.imencode(ext, np.ascontiguousarray(f.crop[:, :, ::-1]), params)
        if ok:
            photos.append((f.path.name, f.data, "image/jpeg"))
            crops.append((f.path.stem + "_crop" + ext, buf.tobytes(), mime))
    return photos, crops


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_argv(name: str, port: int, o: argparse.Namespace, data_dir: Path) -> list[str]:
    """Command line of server ``name`` on ``port``.

    ``FACEGATE_BENCH_WRAP="NAME=COMMAND"`` puts ``COMMAND`` (e.g. ``py-spy record ... --``) in front of
    server ``NAME``'s command line: a profiler that starts the server is its ancestor, which ptrace needs.
    """
    wrap_name, _, wrap = os.environ.get("FACEGATE_BENCH_WRAP", "").partition("=")
    argv = _server_argv(name, port, o, data_dir)
    return [*shlex.split(wrap), *argv] if wrap and wrap_name == name else argv


def _server_argv(name: str, port: int, o: argparse.Namespace, data_dir: Path) -> list[str]:
    py = sys.executable
    dev = o.device
    if ray_ingresses(name) is not None:  # facegate on Ray Serve (a local head node): the same settings, by env
        ray = [py, str(ROOT / "benchmarks" / "ray_http.py"), "--port", str(port), "--device", dev,
               "--precision", o.precision, "--compile", o.compile,
               "--ingress-replicas", str(ray_ingresses(name)), "--data-dir", str(data_dir)]  # fmt: skip
        return ray if o.max_batch_size is None else [*ray, "--max-batch-size", str(o.max_batch_size)]
    if name.startswith("facegate"):
        argv = [py, "-m", "facegate", "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)]
        if (profile := profile_of(name)) is not None:
            return [*argv, "--profile", profile]
        if untuned(name):  # what `facegate serve` does with no tuning flag
            return argv
        argv += ["--device", dev, "--precision", o.precision]
        if "FACEGATE_PROFILE" in server_env(name):  # a flag would override the profile's own choice
            argv = [a for a in argv if a not in ("--precision", o.precision)]
        else:
            argv += ["--compile", o.compile]
        if o.max_batch_size is not None:
            argv += ["--max-batch-size", str(o.max_batch_size)]
        if o.max_wait_ms is not None:
            argv += ["--max-wait-ms", str(o.max_wait_ms)]
        # process counts spelled out, so that the serving plan does not choose them: ``facegate`` is one process,
        # ``facegate_mp*`` its front-ends and engines as named
        n = str(engines_of(name))
        workers = str(front_ends_of(name, o.mp_workers)) if name.startswith("facegate_mp") else "1"
        if "FACEGATE_PROFILE" not in server_env(name):
            argv += ["--workers", workers, "--engines", n, "--engines-per-gpu", n]
        return argv
    if name == "naive":
        argv = [py, str(PEERS / "naive_server.py"), "--port", str(port), "--device", dev]
        return [*argv, "--serialize"] if o.naive_serialize else argv
    if name == "litserve":
        argv = [py, str(PEERS / "litserve_server.py"), "--port", str(port), "--device", dev]
        argv += ["--precision", o.peer_precision or o.precision, "--compile", o.peer_compile]
        argv += ["--max-batch-size", "64", "--batch-timeout-ms", str(o.litserve_batch_timeout_ms)]
        if o.litserve_fast_queue:
            argv.append("--fast-queue")
        if o.litserve_api_servers:
            argv += ["--api-servers", str(o.litserve_api_servers)]
        return argv
    raise SystemExit(f"unknown server {name!r}")


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
    env: dict[str, str] = field(default_factory=dict)
    wrapped: bool = False  # started under FACEGATE_BENCH_WRAP's command

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, FACEGATE_LOG_LEVEL=os.environ.get("FACEGATE_LOG_LEVEL", "WARNING"))
        env.update(self.env, PYTHONUNBUFFERED="1")
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

    def pause(self) -> None:
        """SIGSTOP the server's whole session (an idle LitServe polls its queues: ≈0.3 core on 2 CPUs)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)
            time.sleep(0.2)

    def pids(self) -> list[int]:
        return session_pids(self.proc.pid) if self.proc is not None else []

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.wrapped and self.proc.poll() is None:  # a profiler (FACEGATE_BENCH_WRAP) writes its file on SIGINT
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
            with contextlib.suppress(ProcessLookupError):  # then the server it started, in the same session
                os.killpg(self.proc.pid, signal.SIGTERM)
            time.sleep(3)
        if self.proc.poll() is not None and not self.wrapped:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
            os.killpg(self.proc.pid, signal.SIGCONT)  # a paused session handles SIGTERM only once resumed
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop on SIGTERM; killing its session", self.name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # LitServe's workers can outlive the leader
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def log_tail(self, n: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.is_file() else ""


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
    make = request_maker(spec["kind"], spec["pool"], spec["images_per_request"])
    opened = open_sender(spec["url"], make, transport=spec["transport"], concurrency=c, timeout_s=spec["timeout_s"])
    async with opened as send:
        phase = functools.partial(_phase, send, make, concurrency=c, n_requests=None, progress=None)
        if spec["warmup_s"] > 0:
            await phase(duration_s=spec["warmup_s"], start_index=spec["offset"])
        barrier.wait(timeout=spec["barrier_timeout_s"])  # nothing else runs on this loop now
        cpu0 = time.process_time()
        rec = await phase(duration_s=spec["duration_s"], start_index=spec["offset"] + 7_919)
        cpu = time.process_time() - cpu0
    return {"proc": spec["proc"], "concurrency": c, "latencies_s": rec.latencies_s, "errors": dict(rec.errors),
            "error_samples": rec.error_samples, "item_errors": dict(rec.item_errors), "n": rec.n,
            "first_send": rec.first_send, "last_done": rec.last_done, "cpu_s": cpu}  # fmt: skip


def auto_client_procs(concurrency: int, transport: str = "raw") -> int:
    """Client processes for ``concurrency`` clients.

    httpx: one process per 16 clients, at most half of the CPUs (the server needs the rest); one per 32,
    at most a third, left the clients at 100 % CPU on the H200 machine at c=100 and 256. raw: one per 64
    clients, at most 4: it costs about a tenth of httpx's CPU per request.
    """
    if transport == "raw":
        return max(1, min(math.ceil(concurrency / 64), 4, concurrency))
    return max(1, min(math.ceil(concurrency / 16), (os.cpu_count() or 1) // 2, concurrency))


def run_point(server: Server, *, kind: str, pool: list[ImageItem], concurrency: int, o: argparse.Namespace,
              gpu: GpuMonitor | None) -> dict[str, Any]:  # fmt: skip
    """One measured round of (server, kind, concurrency): merged raw client samples and limit diagnostics."""
    procs_n = (
        auto_client_procs(concurrency, o.transport)
        if o.client_procs == "auto"
        else min(int(o.client_procs), concurrency)
    )
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    barrier, out_q, procs = ctx.Barrier(procs_n + 1), ctx.Queue(), []
    k = 1 if kind == "compare" else images_per_request(kind, o)
    request_kind = kind if kind in ("compare", *GALLERY_KINDS) else "embed_aligned"
    wait_s = o.warmup + o.timeout + 60
    for i in range(procs_n):
        spec = {
            "proc": i, "url": server.url, "kind": request_kind, "pool": pool,
            "images_per_request": k,
            "concurrency": concurrency // procs_n + (1 if i < concurrency % procs_n else 0),
            "warmup_s": o.warmup, "duration_s": o.duration, "timeout_s": o.timeout,
            "offset": i * 104_729 + int(time.time()) % 997, "barrier_timeout_s": wait_s,
            "transport": o.transport,
        }  # fmt: skip
        procs.append(ctx.Process(target=_client_main, args=(spec, barrier, out_q), daemon=True))
        procs[-1].start()
    is_fg = server.name.startswith("facegate")
    load0 = os.getloadavg()[0]
    with contextlib.suppress(threading.BrokenBarrierError):  # a failed client reports through the queue
        barrier.wait(timeout=wait_s)
    front_ends = front_ends_of(server.name, o.mp_workers)
    metrics0 = scrape_facegate(server.url, front_ends) if is_fg else {}
    subjects0 = gallery_subjects(server.url, ENROL_GALLERY) if kind == "enrol" else 0
    pids = server.pids()
    th0, m0, t0 = thread_ticks(pids), machine_ticks(), time.perf_counter()
    results = [out_q.get(timeout=o.duration + wait_s + 60) for _ in procs]
    t1, th1, m1 = time.perf_counter(), thread_ticks(pids), machine_ticks()
    metrics1 = scrape_facegate(server.url, front_ends) if is_fg else {}
    subjects1 = gallery_subjects(server.url, ENROL_GALLERY) if kind == "enrol" else 0
    for p in procs:
        p.join(timeout=10)
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(f"client process failed: {failed[0]}")
    firsts = [r["first_send"] for r in results if r["first_send"] is not None]
    wall = max(t1 - t0, 1e-9)
    deltas = [th1[key] - th0.get(key, 0) for key in th1]
    raw: dict[str, Any] = {
        "lat_ms": np.concatenate([np.asarray(r["latencies_s"], np.float64) for r in results]) * 1000.0,
        "n": sum(r["n"] for r in results),
        "elapsed_s": max(r["last_done"] for r in results) - min(firsts) if firsts else 0.0,
        "errors": _add_counts(r["errors"] for r in results),
        "error_samples": merge_error_samples(r.get("error_samples", {}) for r in results),
        "item_errors": _add_counts(r["item_errors"] for r in results),
        "client_procs": procs_n,
        "client_cpu": max(
            r["cpu_s"] / max(r["last_done"] - (r["first_send"] or r["last_done"]), 1e-9) for r in results
        ),
        "server_cpu_cores": sum(deltas) / CLK_TCK / wall,
        "server_top_thread_cpu": max(deltas, default=0) / CLK_TCK / wall,
        **cpu_by_role(th0, th1, pids, wall, engines=engines_of(server.name)),
        "server_processes": len(pids),
        "machine_cpu_busy": (m1[0] - m0[0]) / max(m1[1] - m0[1], 1),
        "loadavg_1m": (load0 + os.getloadavg()[0]) / 2,
    }
    if kind == "enrol":  # subjects the store took in the measured window (a refused photo enrols none)
        raw["enrolled_subjects_s"] = (subjects1 - subjects0) / wall
    if is_fg:
        raw["mean_batch_size"] = mean_batch(metrics0, metrics1)
        raw["time_breakdown"] = time_breakdown(metrics0, metrics1, wall)
        raw["front_end_spread"] = front_end_spread(metrics0, metrics1)
    if gpu is not None:
        raw.update(gpu.window(t0, t1))
    return raw


def _add_counts(dicts: Any) -> dict[str, int]:
    return dict(sum((Counter(d) for d in dicts), Counter()))


def summarise(server: str, kind: str, c: int, per_req: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of a point: median req/s over rounds, percentiles over every request."""
    lat = np.concatenate([r["lat_ms"] for r in rounds])
    n_ok = int(lat.size)
    ok_rates = [r["lat_ms"].size / r["elapsed_s"] if r["elapsed_s"] else 0.0 for r in rounds]
    rates = [r["n"] / r["elapsed_s"] if r["elapsed_s"] else 0.0 for r in rounds]
    ok_req_s = float(np.median(ok_rates))

    def pct(q: float) -> float | None:
        return round(float(np.percentile(lat, q)), 2) if n_ok else None

    def avg(key: str) -> float:
        return round(float(np.mean([r[key] for r in rounds])), 3)

    row: dict[str, Any] = {
        "server": server, "kind": kind, "concurrency": c, "images_per_request": per_req,
        "rounds": len(rounds), "n": sum(r["n"] for r in rounds), "n_ok": n_ok,
        "elapsed_s": round(sum(r["elapsed_s"] for r in rounds), 3),
        "req_s": round(float(np.median(rates)), 2), "ok_req_s": round(ok_req_s, 2),
        "ok_req_s_rounds": [round(x, 2) for x in ok_rates], "images_s": round(ok_req_s * per_req, 2),
        "p50_ms": pct(50), "p95_ms": pct(95), "p99_ms": pct(99),
        "mean_ms": round(float(lat.mean()), 2) if n_ok else None,
        "max_ms": round(float(lat.max()), 2) if n_ok else None,
        "errors": _add_counts(r["errors"] for r in rounds),
        "error_samples": merge_error_samples(r.get("error_samples", {}) for r in rounds),
        "item_errors": _add_counts(r["item_errors"] for r in rounds),
        "client_procs": rounds[0]["client_procs"], "client_cpu_max": round(max(r["client_cpu"] for r in rounds), 2),
        "server_cpu_cores": avg("server_cpu_cores"), "server_top_thread_cpu": avg("server_top_thread_cpu"),
        "server_processes": rounds[0]["server_processes"], "machine_cpu_busy": avg("machine_cpu_busy"),
        "loadavg_1m": avg("loadavg_1m"),
    }  # fmt: skip
    if "enrolled_subjects_s" in rounds[0]:
        row["enrolled_subjects_s"] = avg("enrolled_subjects_s")
    if "cores_by_role" in rounds[0]:
        roles = sorted({k for r in rounds for k in r.get("cores_by_role", {})})
        row["cores_by_role"] = {k: round(float(np.mean([r["cores_by_role"].get(k, 0.0) for r in rounds])), 3)
                                for k in roles}  # fmt: skip
        row["top_thread_role"] = Counter(r["top_thread_role"] for r in rounds).most_common(1)[0][0]
        row["front_end_cores_rounds"] = [r.get("front_end_cores", []) for r in rounds]
    if "front_end_spread" in rounds[0]:  # per round: each front-end's share of the requests and mean latency
        row["front_end_spread_rounds"] = [r["front_end_spread"] for r in rounds]
    cores = row["server_cpu_cores"]
    row["ok_req_per_server_cpu_s"] = round(ok_req_s / cores, 2) if cores > 0.05 else None  # robust to CPU share
    if "mean_batch_size" in rounds[0]:
        stages = {st for r in rounds for st in r["mean_batch_size"]}
        row["mean_batch_size"] = {
            st: round(float(np.mean([r["mean_batch_size"][st] for r in rounds if st in r["mean_batch_size"]])), 2)
            for st in sorted(stages)
        }
    if "time_breakdown" in rounds[0]:
        tbs = [r["time_breakdown"] for r in rounds]
        row["time_breakdown"] = {
            part: {
                k: round(float(np.mean([tb[part][k] for tb in tbs if k in tb[part]])), 3)
                for k in sorted({k for tb in tbs for k in tb[part]})
            }
            for part in tbs[0]
        }
    if rounds[0].get("gpu_samples"):
        row["gpu_util_mean"] = round(float(np.mean([r["gpu_util_mean"] or 0 for r in rounds])), 1)
        row["gpu_util_max"] = max(r["gpu_util_max"] or 0 for r in rounds)
        row["gpu_mem_used_max_mib"] = max(r["gpu_mem_used_max_mib"] or 0 for r in rounds)
    row["limits"] = limits_of(row)
    return row


def limits_of(row: dict[str, Any]) -> list[str]:
    """Which resource plausibly capped this row (heuristic flags; see the module docstring)."""
    flags = {
        "client_cpu": row["client_cpu_max"] >= SATURATED,
        "server_thread_cpu": row["server_top_thread_cpu"] >= SATURATED,
        "machine_cpu": row["machine_cpu_busy"] >= 0.9,
        "gpu": (row.get("gpu_util_mean") or 0) >= 85,
    }
    return [k for k, v in flags.items() if v]


def start_server(
    name: str, o: argparse.Namespace, workdir: Path, gpu: GpuMonitor | None, photos: list[ImageItem]
) -> Server:
    """Start ``name``, wait for /readyz, record cold start and idle memory; raises RuntimeError on failure.

    With a gallery kind, a facegate server's store gets its galleries first (:func:`prefill_gallery`), and
    LFW identities are enrolled once it is ready (:func:`enrol_identities`)."""
    port = free_port()
    data_dir = workdir / f"data_{name}"
    data_dir.mkdir(exist_ok=True)
    gallery: dict[str, Any] = {}
    if name.startswith("facegate") and GALLERY_KINDS & set(o.kinds):
        gallery = prefill_gallery(data_dir / "gallery.sqlite3", o)
        log.info("%s: gallery prefilled %s", name, gallery)
    env = dict(kv.split("=", 1) for kv in o.server_env)
    env.update(server_env(name))  # the setting(s) this server is an A/B of
    srv = Server(name, server_argv(name, port, o, data_dir), port, workdir / f"{name}.log", env=env)
    srv.wrapped = os.environ.get("FACEGATE_BENCH_WRAP", "").partition("=")[0] == name
    srv.info["argv"] = ["python" if a == sys.executable else a for a in srv.argv]
    used0 = gpu.read()[1] if gpu is not None else 0.0
    log.info("starting %s: %s", name, " ".join(srv.argv))
    srv.start()
    try:
        srv.info["cold_start_s"] = round(srv.wait_ready(o.ready_timeout), 2)
    except RuntimeError:
        srv.stop()
        raise
    log.info("%s ready in %.1f s", name, srv.info["cold_start_s"])
    if gallery:
        try:
            gallery.update(enrol_identities(srv.url, photos, o.gallery_identities))
        except httpx.HTTPError:
            srv.stop()
            raise
        srv.info["gallery"] = gallery
        log.info("%s: gallery %s", name, gallery)
    if gpu is not None:
        time.sleep(0.5)
        srv.info["gpu_memory_idle"] = process_gpu_mib(gpu, srv.pids())
        srv.info["gpu_memory_idle"]["device_used_delta_mib"] = round(gpu.read()[1] - used0, 1)
    if name.startswith("facegate"):
        srv.info["torch_memory_idle_mib"] = scrape_facegate(srv.url)["gpu_memory_mib"]
    return srv


def run_all(
    o: argparse.Namespace, pools: dict[str, list[ImageItem]], workdir: Path, gpu: GpuMonitor | None,
    state: dict[str, Any], save: Callable[[], None],
) -> None:  # fmt: skip
    """Start the servers one by one (each paused once ready), then run every point round-robin over them.

    Points go concurrency by concurrency (both kinds at each), in the order given, so a ``--budget-s`` that
    runs out drops the last concurrencies, not a whole kind. Fills ``state["servers"]``, ``state["samples"]``
    and ``state["skipped"]``, calling ``save()`` after every point (a killed run keeps what it measured).
    """
    infos, samples, skipped = state["servers"], state["samples"], state["skipped"]
    servers: list[Server] = []

    def over_budget(need_s: float) -> bool:
        return bool(o.budget_s) and time.perf_counter() - state["t0"] + need_s > o.budget_s

    def measure(srv: Server, kind: str, c: int) -> None:
        srv.resume()
        try:
            raw = run_point(srv, kind=kind, pool=pools[kind], concurrency=c, o=o, gpu=gpu)
        except Exception as exc:
            log.error("%s %s c=%d failed: %s", srv.name, kind, c, exc)
            srv.info.setdefault("errors", []).append(f"{kind} c={c}: {exc}"[-1000:])
            return
        finally:
            srv.pause()  # a paused server uses no CPU while the others are measured
        samples.setdefault((srv.name, kind, c), []).append(raw)
        log.info(
            "%-16s %-13s c=%-4d %8.1f req/s  p50 %.1f ms  err %s  (%.0f s)",
            srv.name, kind, c, raw["lat_ms"].size / max(raw["elapsed_s"], 1e-9),
            float(np.median(raw["lat_ms"])) if raw["lat_ms"].size else float("nan"), raw["errors"] or "-",
            time.perf_counter() - state["t0"],
        )  # fmt: skip

    def finish(srv: Server) -> None:
        srv.resume()
        if srv.proc is not None and srv.proc.poll() is None:
            if gpu is not None:
                srv.info["gpu_memory_after_load"] = process_gpu_mib(gpu, srv.pids())
            if srv.name.startswith("facegate"):
                srv.info["torch_memory_after_load_mib"] = scrape_facegate(srv.url)["gpu_memory_mib"]
        srv.stop()
        if o.keep_logs is not None and srv.log_path.is_file():
            o.keep_logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(srv.log_path, o.keep_logs / srv.log_path.name)

    try:
        for name in o.servers:
            if over_budget(30.0):
                skipped.append(f"{name}: not started (budget)")
                continue
            try:
                srv = start_server(name, o, workdir, gpu, pools["compare"])
            except (RuntimeError, httpx.HTTPError) as exc:
                log.error("%s failed to start: %s", name, exc)
                infos[name] = {"error": str(exc)[-2000:]}
                continue
            servers.append(srv)
            infos[name] = srv.info
            srv.pause()
            save()
        for _ in range(o.rounds):
            for c in o.concurrency:
                for kind in o.kinds:
                    for srv in servers:
                        if over_budget(o.warmup + o.duration + 5.0):
                            skipped.append(f"{srv.name} {kind} c={c} (budget)")
                            continue
                        measure(srv, kind, c)
                        save()
    finally:
        for srv in servers:
            finish(srv)


def rows_of(samples: dict[tuple[str, str, int], list[dict[str, Any]]], o: argparse.Namespace) -> list[dict[str, Any]]:
    """One summarised row per (server, kind, concurrency), sorted by kind, concurrency, server."""
    rows = [summarise(name, kind, c, images_per_request(kind, o), raws) for (name, kind, c), raws in samples.items()]
    order = {n: i for i, n in enumerate(o.servers)}
    rows.sort(key=lambda r: (o.kinds.index(r["kind"]), r["concurrency"], order[r["server"]]))
    return rows


def ratios(rows: list[dict[str, Any]], base: str = "facegate") -> dict[str, dict[str, dict[str, float | None]]]:
    """``{"facegate/<other>": {kind: {concurrency: ok_req_s ratio}}}`` for every other server present."""
    by = {(r["server"], r["kind"], r["concurrency"]): r for r in rows}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for other in [s for s in dict.fromkeys(r["server"] for r in rows) if s != base]:
        table: dict[str, dict[str, float | None]] = {}
        for (srv, kind, c), r in by.items():
            if srv == base:
                o = by.get((other, kind, c))
                table.setdefault(kind, {})[str(c)] = (
                    round(r["ok_req_s"] / o["ok_req_s"], 2) if o and o["ok_req_s"] else None
                )
        out[f"{base}/{other}"] = table
    return out


def markdown(result: dict[str, Any]) -> str:
    """Per request kind: req/s (p50 / p99 ms) per server with facegate's ratios, then req per server CPU-second."""
    rows, lines = result["rows"], []
    servers = list(dict.fromkeys(r["server"] for r in rows))

    def row(s: str, kind: str, c: int) -> dict[str, Any] | None:
        return next((x for x in rows if (x["server"], x["kind"], x["concurrency"]) == (s, kind, c)), None)

    for kind in dict.fromkeys(r["kind"] for r in rows):
        keys = [k for k in result["ratios"] if kind in result["ratios"][k]]
        conc = list(dict.fromkeys(r["concurrency"] for r in rows if r["kind"] == kind))
        head = ["concurrency", *servers, *keys]
        lines += [f"\n**{kind}**: req/s (p50 / p99 ms)\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in conc:
            cells = [str(c)]
            for s in servers:
                r = row(s, kind, c)
                err = f", {sum(r['errors'].values())} err" if r and r["errors"] else ""
                cells.append("–" if r is None else f"{r['ok_req_s']:.1f} ({r['p50_ms']} / {r['p99_ms']}{err})")
            cells += ["–" if (v := result["ratios"][k][kind].get(str(c))) is None else f"{v:.2f}×" for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [f"\n**{kind}**: req per server CPU-second (server CPU cores used)\n"]
        lines += ["| " + " | ".join(["concurrency", *servers]) + " |", "|" + "---|" * (len(servers) + 1)]
        for c in conc:
            cells = [str(c)]
            for s in servers:
                r = row(s, kind, c)
                ok = r is not None and r["ok_req_per_server_cpu_s"] is not None
                cells.append(f"{r['ok_req_per_server_cpu_s']:.1f} ({r['server_cpu_cores']:.2f})" if ok else "–")  # type: ignore[index]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add("--precision", default="fp32", choices=["fp32", "fp16", "bf16"], help="facegate's precision")
    add("--compile", default="off", choices=["off", "graphs", "inductor"], help="facegate's compile mode")
    add("--peer-precision", default=None, help="LitServe's precision (default: --precision; naive is always fp32)")
    add("--peer-compile", default="off", choices=["off", "graphs", "inductor"], help="LitServe's compile mode")
    add("--max-batch-size", type=int, default=None, help="facegate's engine batch size (default: its config)")
    add("--max-wait-ms", type=float, default=None, help="facegate's batch fill wait (default: its config)")
    add("--images", type=Path, default=None, help="folder of LFW-layout photos")
    add("--n-images", type=int, default=256)
    add("--crop-format", default="jpg", choices=["jpg", "png"])
    add("--concurrency", default="1,8,32", help="comma-separated list")
    add("--kinds", default=DEFAULT_KINDS, help=f"subset of {','.join(KIND_CHOICES)}")
    add("--servers", default="facegate,naive,litserve", help="comma-separated; server_variants.py says which names")
    add("--budget-s", type=float, default=0.0, help="start no point that would end after this (0: no limit)")
    add("--rounds", type=int, default=1, help="measured rounds per point (req/s: median; percentiles: all)")
    add("--duration", type=float, default=5.0, help="measured seconds per point and round")
    add("--warmup", type=float, default=1.0, help="unrecorded seconds before each measured round")
    add("--images-per-request", type=int, default=1, help="images per embed_aligned request")
    add("--batch-images", type=int, default=8, help="crops per embed_aligned_batch request")
    add("--gallery-size", type=int, default=100_000, help="search: synthetic templates in the searched gallery")
    add("--gallery-identities", type=int, default=100, help="search: LFW identities enrolled from the pool")
    add("--gallery-model", default="sface", help="search/enrol: the served recognizer (the galleries' model)")
    add("--gallery-dim", type=int, default=128, help="search/enrol: its embedding size")
    add("--enrol-photos", type=int, default=16, help="photos per enrol request")
    add("--keep-logs", type=Path, default=None, help="copy every server's log into this folder at the end")
    add("--client-procs", default="auto", help="'auto' or a number of client processes")
    add("--timeout", type=float, default=60.0, help="per-request client timeout")
    add("--ready-timeout", type=float, default=300.0)
    add("--litserve-batch-timeout-ms", type=float, default=3.0)
    add("--litserve-fast-queue", action="store_true", help="LitServe's ZMQ transport")
    add("--litserve-api-servers", type=int, default=None)
    add("--mp-workers", type=int, default=4, help="front-end processes of the facegate_mp server")
    add("--transport", choices=TRANSPORTS, default="raw",
        help="load generator's HTTP client: raw (rawhttp.py, lean) or httpx")  # fmt: skip
    add("--naive-serialize", action="store_true", help="naive: one request in the model at a time")
    add("--server-env", action="append", default=[], metavar="KEY=VALUE", help="for every server (repeatable)")
    add("--no-bare-context", dest="bare_context", action="store_false")
    add("--out", type=Path, default=Path("benchmarks/results/http_e2e.json"))
    o = p.parse_args(argv)
    o.concurrency = [int(x) for x in str(o.concurrency).split(",") if x.strip()]
    o.kinds = [k.strip() for k in o.kinds.split(",") if k.strip()]
    o.servers = [s.strip() for s in o.servers.split(",") if s.strip()]
    bad = [k for k in o.kinds if k not in KIND_CHOICES] + [x for x in o.servers if not is_known(x)]
    if bad:
        p.error(f"unknown kind(s)/server(s) {bad}; kinds {KIND_CHOICES}, servers: see server_variants.py")
    return o


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    o = parse_args(argv)
    gpu = GpuMonitor(gpu_index()) if o.device in ("auto", "cuda") else None
    gpu = gpu if gpu is not None and gpu.available else None
    if o.device == "auto":
        o.device = "cuda" if gpu is not None else "cpu"
    if o.images is None:
        if not os.environ.get("FACEGATE_LFW_ROOT"):
            raise SystemExit("give --images DIR or set FACEGATE_LFW_ROOT")
        o.images = Path(os.environ["FACEGATE_LFW_ROOT"]) / "lfw-deepfunneled"
    t_all = time.perf_counter()
    photos, crops = prepare_images(o.images, o.n_images, o.crop_format)
    log.info("image pool: %d photos, %d crops (%.1f s)", len(photos), len(crops), time.perf_counter() - t_all)
    result: dict[str, Any] = {"benchmark": "http_e2e", "command": " ".join(["python", *sys.argv])}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(o).items()}
    config.update(n_photos=len(photos), n_crops=len(crops), gpu=None if gpu is None else gpu.name())
    config["photo_bytes_mean"] = round(sum(len(p[1]) for p in photos) / len(photos))
    config["crop_bytes_mean"] = round(sum(len(c[1]) for c in crops) / len(crops))
    config["client"] = client_description(o.transport)
    state: dict[str, Any] = {"t0": t_all, "servers": {}, "samples": {}, "skipped": []}

    def save(final: bool = False) -> None:
        rows = rows_of(state["samples"], o)
        result.update(servers=state["servers"], rows=rows, ratios=ratios(rows), skipped=state["skipped"])
        result.update(complete=final, total_s=round(time.perf_counter() - t_all, 1))
        # env_record asks torch for the device name: only at the very end, after every measurement
        result["env"] = env_record(**config) if final else {"partial": True, "config": config}
        result["table_md"] = markdown(result)
        write_json(o.out, result)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)  # e.g. an outer `timeout`: stop the servers, keep the results
    try:
        if gpu is not None:
            gpu.start()
            if o.bare_context:
                result["bare_cuda_context"] = bare_context_mib(gpu)
                log.info("bare CUDA context: %s", result["bare_cuda_context"])
        with tempfile.TemporaryDirectory(prefix="http_e2e_") as tmp:
            pools = {"compare": photos, "embed_aligned": crops, "embed_aligned_batch": crops, "search": photos,
                     "enrol": photos}  # fmt: skip
            run_all(o, pools, Path(tmp), gpu, state, save)
    except KeyboardInterrupt as exc:
        log.warning("interrupted (%s): writing what was measured", exc)
        result["interrupted"] = str(exc)
    finally:
        if gpu is not None:
            gpu.stop()
    save(final=True)
    print(result["table_md"])  # CLI output
    log.info("wrote %s in %.0f s", o.out, result["total_s"])
    failed = any("error" in s or "errors" in s for s in result["servers"].values())
    return 1 if failed or not result["rows"] or "interrupted" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
