"""Soak: a facegate server under steady load for a long time; does its memory grow?

Starts ``facegate serve`` (any extra flags after ``--``), then runs the closed-loop load generator of
`loadgen.py` in windows of ``--window`` seconds until ``--duration`` has passed, alternating
compare requests (two LFW photos, detection) and aligned-crop embeds. After every window it samples the
resident memory (RSS) of the server processes (summed, and per pid, so that a growing one can be named),
the driver's GPU memory of those processes (NVML, when there is a GPU) and torch's allocated / reserved
bytes from ``/metrics``. The JSON holds the time series and, for each series, the least-squares slope over
the second half of the run (MiB per minute) and the growth from the first to the last sample of that
half: the first half is warm-up (caches and pools fill).

  python benchmarks/soak.py --duration 600 --out benchmarks/results/soak-cpu2.json -- --device cpu --workers 2
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from loadgen import run_http_bench
from monitor import GpuMonitor, process_gpu_mib, session_pids

log = logging.getLogger("soak")


def _client_window(url: str, kind: str, pool: list[bytes], concurrency: int, window: float) -> dict[str, Any]:
    r = run_http_bench(url, kind=kind, images=pool, concurrency=concurrency, duration_s=window)  # type: ignore[arg-type]
    return {"ok_req_s": r.ok_req_s, "p99_ms": r.p99_ms, "errors": r.errors}


def window_load(
    clients: ProcessPoolExecutor | None, url: str, kind: str, pool: list[bytes], concurrency: int, n: int, window: float
) -> tuple[float, float | None, dict[str, int]]:
    """One window of closed-loop load, in this process or split over ``n`` client processes.

    Returns successful req/s (summed), p99 ms (the largest of the clients' p99s: conservative) and errors.
    """
    if clients is None:
        parts = [_client_window(url, kind, pool, concurrency, window)]
    else:
        share = [concurrency // n + (i < concurrency % n) for i in range(n)]
        futs = [clients.submit(_client_window, url, kind, pool, c, window) for c in share if c > 0]
        parts = [f.result() for f in futs]
    errors: dict[str, int] = {}
    for part in parts:
        for k, v in part["errors"].items():
            errors[k] = errors.get(k, 0) + v
    p99s = [part["p99_ms"] for part in parts if part["p99_ms"] is not None]
    return sum(part["ok_req_s"] for part in parts), (max(p99s) if p99s else None), errors


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_by_pid(pids: list[int]) -> dict[str, float]:
    """Resident MiB per process (``pid`` as a string key); processes gone meanwhile are left out."""
    out: dict[str, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as fh:
                m = re.search(r"^VmRSS:\s+(\d+) kB", fh.read(), re.M)
        except OSError:
            continue
        if m:
            out[str(pid)] = round(int(m.group(1)) / 1024.0, 1)
    return out


def torch_mib(url: str) -> dict[str, float]:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {
        m.group(1): float(m.group(2)) / 2**20
        for m in re.finditer(r'^facegate_gpu_memory_bytes\{kind="(\w+)"\} ([0-9.e+-]+)', text, re.M)
    }


def trend(t_s: list[float], ys: list[float]) -> dict[str, float | None]:
    """Slope (MiB/min) and growth (MiB) over the second half of the samples."""
    half = len(ys) // 2
    t, y = np.asarray(t_s[half:]), np.asarray(ys[half:], dtype=np.float64)
    if len(y) < 3 or np.isnan(y).any():
        return {"slope_mib_per_min": None, "growth_mib": None}
    slope = float(np.polyfit(t / 60.0, y, 1)[0])
    return {"slope_mib_per_min": round(slope, 3), "growth_mib": round(float(y[-1] - y[0]), 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--window", type=float, default=15.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--clients",
        type=int,
        default=1,
        help="load-generator processes sharing --concurrency (on the H200 one in-process client drove 106-204 "
        "req/s where 7 client processes drove 728 compare req/s)",
    )
    p.add_argument("--images", type=Path, default=None, help="LFW-layout folder (default $FACEGATE_LFW_ROOT)")
    p.add_argument("--n-images", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    o = p.parse_args(own)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    root = o.images or Path(os.environ["FACEGATE_LFW_ROOT"]) / "lfw-deepfunneled"
    from cpu_models import lfw_faces

    faces = lfw_faces(root, o.n_images)
    photos = [f.data for f in faces]
    import cv2

    crops = [cv2.imencode(".png", np.ascontiguousarray(f.crop[:, :, ::-1]))[1].tobytes() for f in faces]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data_dir = tempfile.mkdtemp(prefix="fg-soak-")
    cmd = [sys.executable, "-m", "facegate", "serve", "--port", str(port), "--data-dir", data_dir, *server_args]
    env = {**os.environ, "FACEGATE_LOG_LEVEL": "WARNING"}
    srv = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    gpu = GpuMonitor()
    clients = ProcessPoolExecutor(o.clients, mp_context=mp.get_context("spawn")) if o.clients > 1 else None
    res: dict[str, Any] = {"benchmark": "soak", "command": " ".join([sys.executable, *sys.argv]), "server": cmd}
    # the settings given to the server through the environment (scripts/gpu-soak.sh's SOAK_ENV)
    given = sorted(env.items())
    res["server_env"] = {k: v for k, v in given if k.startswith("FACEGATE_") and k != "FACEGATE_CODE_COMMIT"}
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if srv.poll() is not None or time.monotonic() - t0 > 600:
                raise SystemExit("the server did not get ready")
            time.sleep(0.5)
        res["cold_start_s"] = round(time.monotonic() - t0, 2)
        samples: list[dict[str, Any]] = []
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < o.duration:
            kind, pool = ("compare", photos) if i % 2 == 0 else ("embed_aligned", crops)
            ok_req_s, p99_ms, errors = window_load(clients, url, kind, pool, o.concurrency, o.clients, o.window)
            pids = session_pids(srv.pid)
            by_pid = rss_by_pid(pids)
            row = {
                "t_s": round(time.monotonic() - start, 1), "kind": kind, "ok_req_s": round(ok_req_s, 1),
                "p99_ms": p99_ms, "errors": errors, "processes": len(pids),
                "rss_mib": round(sum(by_pid.values()), 1), "rss_by_pid": by_pid,
                "gpu_driver_mib": process_gpu_mib(gpu, pids)["mib"] if gpu.available else None,
                "torch": {k: round(v, 1) for k, v in torch_mib(url).items()},
            }  # fmt: skip
            samples.append(row)
            log.info("%s", row)
            i += 1
            res["samples"] = samples
            write_json(o.out, res)
        t = [s["t_s"] for s in samples]
        res["trend"] = {
            "rss_mib": trend(t, [s["rss_mib"] for s in samples]),
            "gpu_driver_mib": trend(t, [s["gpu_driver_mib"] or np.nan for s in samples]) if gpu.available else None,
            "torch_reserved_mib": trend(t, [s["torch"].get("reserved", np.nan) for s in samples]),
            # which process grows: per pid, over the samples it is in (a restarted worker gets a new pid)
            "rss_by_pid": {
                pid: trend([s["t_s"] for s in samples if pid in s["rss_by_pid"]],
                           [s["rss_by_pid"][pid] for s in samples if pid in s["rss_by_pid"]])
                for pid in sorted({p for s in samples for p in s["rss_by_pid"]})
            },
        }  # fmt: skip
        res["errors_total"] = sum(sum(s["errors"].values()) for s in samples)
        res["env"] = env_record(
            duration=o.duration, window=o.window, concurrency=o.concurrency, clients=o.clients, server=server_args
        )
        write_json(o.out, res)
        log.info("trend: %s", res["trend"])
    finally:
        if clients is not None:
            clients.shutdown(cancel_futures=True)
        os.killpg(srv.pid, signal.SIGINT)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
