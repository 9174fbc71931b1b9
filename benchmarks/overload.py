"""Overload at a multiple of the capacity measured in the same run, against ``facegate serve`` in a child
process (real default models).

Phases (``facegate.bench.overload.overload_run``): warm-up; one request at a time (its latency);
capacity in a closed loop of ``--concurrency`` clients; then ``--factor`` × capacity in an open loop for
``--seconds``, with the server's RSS sampled and, when the arrivals stop, the time until a new request
is answered. Writes one JSON (``--out``, default ``benchmarks/results/overload_<device>.json``).

The load comes from one Python process (httpx): on the 2-core CPU box it sent about 80 requests/s at
most, so an offered rate above that measures the client, not the server (its latencies grow in the
client's own queue). Check ``overload.sent / seconds`` against ``offered_per_s`` before reading the rest.

    PYTHONPATH=src python benchmarks/overload.py --device cpu --seconds 60
    PYTHONPATH=src python benchmarks/overload.py --device cuda --seconds 60 --concurrency 256 \\
        --serve-args "--precision fp16 --compile graphs --workers 8"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, free_port, write_json
from facegate.bench.overload import overload_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=60.0, help="overload phase")
    ap.add_argument("--capacity-seconds", type=float, default=20.0)
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16, help="clients of the capacity phase")
    ap.add_argument("--route", default="/api/compare", choices=["/api/compare", "/api/detect"])
    ap.add_argument("--serve-args", default="", help="extra `facegate serve` flags")
    ap.add_argument("--lfw-root", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "data/lfw")))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    people = args.lfw_root / "lfw-deepfunneled" / "Colin_Powell"
    a, b = (people / "Colin_Powell_0001.jpg").read_bytes(), (people / "Colin_Powell_0002.jpg").read_bytes()
    files = (
        [("img1", ("a.jpg", a, "image/jpeg")), ("img2", ("b.jpg", b, "image/jpeg"))]
        if args.route == "/api/compare"
        else [("image", ("a.jpg", a, "image/jpeg"))]
    )
    port = free_port()
    data = tempfile.mkdtemp(prefix="facegate-overload-")
    cmd = [sys.executable, "-m", "facegate", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", args.device, "--data-dir", data, *shlex.split(args.serve_args)]  # fmt: skip
    log_path = Path(data) / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        out = asyncio.run(
            overload_run(
                url,
                args.route,
                files,
                pid=proc.pid,
                concurrency=args.concurrency,
                capacity_s=args.capacity_seconds,
                overload_s=args.seconds,
                factor=args.factor,
            )
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    result = {"env": env_record(**{k: str(v) for k, v in vars(args).items()}), "loadavg_after": load, **out}
    path = args.out or Path(__file__).resolve().parent / "results" / f"overload_{args.device}.json"
    write_json(path, result)
    print(json.dumps({k: out[k] for k in ("capacity_per_s", "goodput_ratio", "rss_growth", "recovery_s")}))
    print(json.dumps({"admitted_p99_s": out["overload"]["ok_p99_s"], "shed_p99_s": out["overload"]["shed_p99_s"]}))


if __name__ == "__main__":
    main()
