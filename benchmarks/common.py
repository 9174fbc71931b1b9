"""Shared helpers for the benchmark scripts: environment record, CUDA timing, peak measurement."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    """A free loopback TCP port (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(
    data: Path, workers: int, device: str = "cpu", log_file: Any = None, timeout_s: float = 300
) -> tuple[subprocess.Popen[bytes], str]:
    """``facegate serve --workers N --device D`` on a free loopback port and ``data`` as its data folder, in its
    own process group; returns the process and its URL once ``/readyz`` answers 200."""
    port = free_port()
    argv = [sys.executable, "-m", "facegate", "serve", "--workers", str(workers), "--device", device]
    argv += ["--port", str(port), "--data-dir", str(data)]
    env = {**os.environ, "FACEGATE_LOG_LEVEL": "WARNING"}
    if device == "cpu":  # the client shares the cores
        env["OMP_NUM_THREADS"] = "1"
    out = subprocess.STDOUT if log_file is not None else None
    proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=out, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, timeout_s)
    return proc, url


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 300) -> None:
    """Poll ``url/readyz`` until it answers 200; RuntimeError if ``proc`` exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")
        time.sleep(0.2)


def env_record(**config: Any) -> dict[str, Any]:
    """Git commit, torch, GPU/CPU and the benchmark's config: stored with every JSON result."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        dirty = bool(
            subprocess.run(["git", "status", "--porcelain", "-uno"], capture_output=True, text=True).stdout.strip()
        )
    except OSError:
        commit, dirty = "", False
    rec: dict[str, Any] = {
        # FACEGATE_CODE_COMMIT: set it where the checkout's .git is stale (the lent GPU machine runs a copy of
        # the working tree whose .git may be older than the code)
        "code_commit": os.environ.get("FACEGATE_CODE_COMMIT", commit),
        "git_commit": commit,
        "git_dirty": dirty,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model() or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
    }
    return rec


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("" elsewhere): the CPU tables compare one machine's runs only."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def cuda_time(fn: Callable[[], Any], *, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` measured with CUDA events (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def wall_time(fn: Callable[[], Any], *, iters: int, warmup: int = 1) -> float:
    """Mean wall seconds per call (CPU)."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measured_peak_tflops(dtype: torch.dtype = torch.float16, n: int = 8192) -> float:
    """Dense matmul TFLOP/s of this GPU in ``dtype``, measured now (the 'peak' that MFU divides by)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t = cuda_time(lambda: a @ b, iters=10, warmup=3)
    return 2 * n**3 / t / 1e12


def pair_photo_sample(lfw: Path, n: int) -> tuple[dict[str, int], list[str]]:
    """LFW's identity folds (person -> fold) and ``n`` pairs.txt photos (``person/file.jpg``), evenly spaced
    over the sorted list: the sample the quality benchmarks share."""
    from facegate.eval.lfw import pair_images, read_pairs
    from quality_eval import identity_folds

    pairs = read_pairs(lfw)
    every = sorted(pair_images(pairs))
    return identity_folds(pairs), every[:: max(1, len(every) // n)][:n]
