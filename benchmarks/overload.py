"""Overload at a multiple of the capacity measured in the same run, against ``facegate serve`` in a child
process (real default models).

Phases (``overload_client.overload_run``): warm-up; one request at a time; capacity in a closed
loop of ``--concurrency`` clients; then ``--factor`` × capacity in an open loop (``--procs`` client
processes, pre-encoded requests over raw sockets) for ``--seconds``, with the RSS of the server's process
tree sampled and, when the arrivals stop, the time until a new request is answered; then capacity once more (the
box may be shared: ``goodput_ratio_bracketed`` divides by the mean of both capacities). ``--sigterm-after S``
sends SIGTERM S seconds into the overload instead, and records the server's exit status and time.
The JSON records the client's CPU per phase: compare ``overload.sent_per_s`` with ``offered_per_s``.

    PYTHONPATH=src python benchmarks/overload.py --device cpu --seconds 60
    PYTHONPATH=src python benchmarks/overload.py --device cpu --seconds 30 --sigterm-after 10 --variant sigterm
    PYTHONPATH=src python benchmarks/overload.py --device cuda --concurrency 100 --procs 6 --machine h200
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, free_port, wait_ready, write_json
from overload_client import closed_loop, encode, overload_run


def _name(args: argparse.Namespace) -> str:
    return f"overload-{args.machine}" + (f"-{args.variant}" if args.variant else "") + ".json"


async def closed_points(url: str, args: argparse.Namespace, files: list[Any]) -> dict[str, Any]:
    data = encode(url, args.route, files)
    levels = [int(c) for c in args.closed.split(",")]
    await closed_loop(url, data, concurrency=levels[0], seconds=1.0)
    points = []
    for c in levels:
        phase = await closed_loop(url, data, concurrency=c, seconds=args.capacity_seconds)
        points.append({"concurrency": c, **phase.to_dict()})
    return {"points": points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=60.0, help="overload phase")
    ap.add_argument("--capacity-seconds", type=float, default=20.0)
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16, help="clients of the capacity phase")
    ap.add_argument("--procs", type=int, default=1, help="client processes of the open loop")
    ap.add_argument("--route", default="/api/compare", choices=["/api/compare", "/api/detect"])
    closed = "only closed-loop points at these concurrencies (e.g. 100,16,100), each --capacity-seconds long, "
    closed += "right after start-up and a 1 s warm-up (as http_e2e.py runs them)"
    ap.add_argument("--closed", default=None, help=closed)
    ap.add_argument("--sigterm-after", type=float, default=None, help="SIGTERM the server this far into the load")
    ap.add_argument("--serve-args", default="", help="extra `facegate serve` flags")
    ap.add_argument("--lfw-root", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "data/lfw")))
    ap.add_argument("--machine", default=f"cpu{os.cpu_count()}", help="names the JSON: overload-<machine>.json")
    ap.add_argument("--variant", default=None, help="appended to the JSON's name")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    people = args.lfw_root / "lfw-deepfunneled" / "Colin_Powell"
    a, b = (people / "Colin_Powell_0001.jpg").read_bytes(), (people / "Colin_Powell_0002.jpg").read_bytes()
    files = (
        [("img1", ("a.jpg", a, "image/jpeg")), ("img2", ("b.jpg", b, "image/jpeg"))]
        if args.route == "/api/compare"
        else [("image", ("a.jpg", a, "image/jpeg"))]
    )
    loadavg_before = os.getloadavg()  # the box may be shared: what else ran is part of the figures
    port = free_port()
    data = tempfile.mkdtemp(prefix="facegate-overload-")
    cmd = [sys.executable, "-m", "facegate", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", args.device, "--data-dir", data, *shlex.split(args.serve_args)]  # fmt: skip
    log_path = Path(data) / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def sigterm() -> dict[str, Any]:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = None
        return {"exit_status": rc, "exit_s": round(time.monotonic() - t0, 2)}

    try:
        try:
            wait_ready(url, proc, 600)
        except RuntimeError as exc:
            raise SystemExit(f"{exc}: {log_path.read_text()[-2000:]}") from exc
        try:  # the client shares the box with the server: uvloop's callbacks cost it less
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            runner = asyncio.Runner()
        with runner:
            out = (
                runner.run(closed_points(url, args, files))
                if args.closed
                else runner.run(
                    overload_run(
                        url,
                        args.route,
                        files,
                        pid=proc.pid,
                        concurrency=args.concurrency,
                        capacity_s=args.capacity_seconds,
                        overload_s=args.seconds,
                        factor=args.factor,
                        procs=args.procs,
                        stop=(args.sigterm_after, sigterm) if args.sigterm_after is not None else None,
                    )
                )
            )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    log_lines = log_path.read_text(errors="replace").splitlines()
    result = {
        "env": env_record(**{k: str(v) for k, v in vars(args).items()}),
        "command": " ".join(["python", *sys.argv]),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        **out,
        "server_log_tracebacks": sum("Traceback" in line for line in log_lines),
        "server_log_tail": log_lines[-40:] if args.sigterm_after is not None else [],
    }
    write_json(args.out or Path(__file__).resolve().parent / "results" / _name(args), result)
    if args.closed:
        keys = ("concurrency", "ok_per_s", "shed_503", "ok_p99_s", "bound_p10_p50_p90")
        print(json.dumps([{k: p[k] for k in keys} for p in out["points"]]))
        return
    keys = ("capacity_per_s", "offered_per_s", "goodput_ratio", "capacity_after_per_s", "rss_growth", "recovery_s")
    keys += ("goodput_ratio_bracketed", "stop")
    print(json.dumps({k: out.get(k) for k in keys}))
    o = out["overload"]
    keys = ("sent_per_s", "ok_p99_s", "shed_p99_s", "shed_p99_from_send_s", "other", "non_json")
    keys += ("client_cpu_cores", "client_max_lag_s")
    print(json.dumps({k: o[k] for k in keys}))


if __name__ == "__main__":
    main()
