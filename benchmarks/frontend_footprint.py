"""What an HTTP front-end process costs to start and to keep: this tree against a baseline tree.

Two measurements per variant (``head``: this checkout's ``src``; ``baseline``: another tree's ``src``, e.g.
``git archive <commit> src | tar -x -C /tmp/fg_base``), each in fresh processes:

* ``probe`` (``--rounds`` times, variants alternating): a Python process imports what a front-end imports
  (``facegate.api.app``, the service, the pipeline, the gallery index), builds a CPU gallery index,
  and reports the seconds, its peak resident memory (``VmHWM``) and whether torch got loaded.
* ``serve``: ``facegate serve --workers 2 --device cpu``; once ``/readyz`` answers, the resident memory
  (``VmRSS``) of each spawned process, and which of them map torch's library. The engine is the first spawned.

    python benchmarks/frontend_footprint.py --baseline-src /tmp/fg_base/src \
        --out benchmarks/results/frontend_footprint_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json

log = logging.getLogger("frontend_footprint")
ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys, time
t = time.perf_counter()
import facegate.api.app, facegate.service.faces, facegate.pipeline.pipeline
from facegate.gallery.index import GalleryIndex
GalleryIndex("cpu").load_gallery("g", 4, ["a"], [[1.0, 0.0, 0.0, 0.0]])
# VmHWM, not ru_maxrss: Linux carries the forking parent's peak into a child's ru_maxrss across exec
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
rss = int(hwm.split()[1]) / 1024
print(json.dumps({"seconds": time.perf_counter() - t, "max_rss_mib": rss, "torch_loaded": "torch" in sys.modules}))
"""


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "FACEGATE_LOG_LEVEL": "WARNING"}


def probe(src: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env(src), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def serve(src: Path, timeout_s: float = 240.0) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as data:
        argv = [sys.executable, "-m", "facegate", "serve", "--workers", "2", "--device", "cpu"]
        argv += ["--port", str(port), "--data-dir", data]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=_env(src), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError("not ready in time")
                time.sleep(0.25)
            ready_s = time.perf_counter() - t0
            kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            spawned = sorted(
                (int(k) for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()), key=_start_time
            )
            procs = [
                {
                    "role": "engine" if i == 0 else "front-end",
                    "rss_mib": round(_rss_mib(pid), 1),
                    "maps_libtorch": "libtorch" in Path(f"/proc/{pid}/maps").read_text(),
                }
                for i, pid in enumerate(spawned)
            ]
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"ready_s": round(ready_s, 2), "processes": procs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-src", type=Path, required=True, help="the baseline tree's src folder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    o = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    variants = {"head": ROOT / "src", "baseline": o.baseline_src.resolve()}
    probes: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    for r in range(o.rounds):
        for name, src in variants.items():
            probes[name].append(probe(src))
            log.info("probe %s round %d: %s", name, r, probes[name][-1])
    served = {}
    for name, src in variants.items():
        served[name] = serve(src)
        log.info("serve %s: %s", name, served[name])
    summary = {}
    for name in variants:
        secs = sorted(x["seconds"] for x in probes[name])
        fronts = [x["rss_mib"] for x in served[name]["processes"] if x["role"] == "front-end"]
        summary[name] = {
            "probe_seconds_median": round(secs[len(secs) // 2], 3),
            "probe_seconds_range": [round(secs[0], 3), round(secs[-1], 3)],
            "probe_max_rss_mib": round(max(x["max_rss_mib"] for x in probes[name]), 1),
            "probe_torch_loaded": any(x["torch_loaded"] for x in probes[name]),
            "front_end_rss_mib": fronts,
            "front_ends_mapping_libtorch": sum(
                x["maps_libtorch"] for x in served[name]["processes"] if x["role"] == "front-end"
            ),
        }
    payload = {
        "benchmark": "frontend_footprint",
        "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])]),
        "probes": probes,
        "serve": served,
        "summary": summary,
        "env": env_record(rounds=o.rounds, baseline_src=str(o.baseline_src)),
    }
    write_json(o.out, payload)
    log.info("summary: %s", json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
