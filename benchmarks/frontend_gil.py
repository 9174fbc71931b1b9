"""GIL time per request of one front-end process (or of the engine process), for an A/B of their code on a
CPU box.

One front-end (uvicorn, httptools + uvloop, in this process's child) is fed by an engine process with the
tiny random-weight recognizer on the CPU; ``facegate bench http`` sends aligned-crop embed requests; ``py-spy
record --gil`` samples the front-end only (so the engine's compute does not count). The figure is GIL samples
per request at a fixed sampling rate: lower is less front-end Python per request. Each ``--variant
LABEL=SRC_DIR`` runs the front-end and engine from that ``src`` folder (e.g. a ``git archive`` of an older
commit; the load generator always comes from this checkout); variants alternate for ``--rounds`` rounds.
``--target engine`` samples the engine process instead; every row also has the engine's per-batch phase
times over the sampled window (``/metrics``: prepare and execute ms per batch, including any wait for the GIL).

python benchmarks/frontend_gil.py --py-spy /path/to/py-spy --variant old=/tmp/old/src --variant new=src \\
    --out benchmarks/results/frontend_gil_cpu.json
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from monitor import scrape_facegate, time_breakdown

log = logging.getLogger("frontend_gil")
ROOT = Path(__file__).resolve().parents[1]
SERVER = """
import os, sys, tempfile
from pathlib import Path
import uvicorn
from facegate.config import Settings
from facegate.api.multiprocess import environment, start_engines

if __name__ == "__main__":
    settings = Settings(device="cpu", data_dir=Path(tempfile.mkdtemp()), max_wait_ms=1.0, cpu_chunk=64)
    engines = start_engines(settings, tiny=True)
    os.environ.update(environment(engines))
    try:
        uvicorn.run("facegate.api.multiprocess:frontend_app", factory=True, host="127.0.0.1",
                    port=int(sys.argv[1]), lifespan="on", access_log=False, http="httptools", loop="uvloop",
                    log_level="warning")
    finally:
        for e in engines:
            e.stop()
"""


def _wait_ready(port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"front-end on port {port} not ready")


def engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (a multiprocessing spawn child, not the tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in map(int, children):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return pid
    raise SystemExit(f"no engine process among the children of {server_pid}")


def run_variant(label: str, src: Path, a: argparse.Namespace, crop: Path, tmp: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "FACEGATE_LOG_LEVEL": "WARNING"}
    script = tmp / "server.py"
    script.write_text(SERVER)
    srv = subprocess.Popen([sys.executable, str(script), str(port)], env=env)
    try:
        _wait_ready(port)
        bench_out = tmp / f"bench_{label}.json"
        bench = subprocess.Popen(
            [sys.executable, "-m", "facegate", "bench", "http", "--url", f"http://127.0.0.1:{port}", "--kind",
             "embed_aligned", "--images", str(crop), "-c", str(a.concurrency), "--duration", str(a.seconds + 8),
             "--images-per-request", str(a.images_per_request), "--no-progress", "--out", str(bench_out)],
            env={**env, "PYTHONPATH": str(ROOT / "src")},  # the same load generator for every variant
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(4)
        raw = tmp / f"gil_{label}.txt"
        pid = srv.pid if a.target == "front-end" else engine_pid(srv.pid)
        before = scrape_facegate(f"http://127.0.0.1:{port}")
        t0 = time.perf_counter()
        subprocess.run(
            [a.py_spy, "record", "--pid", str(pid), "--gil", "--rate", str(a.rate), "-f", "raw", "-o", str(raw),
             "--duration", str(a.seconds)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        phases = time_breakdown(before, scrape_facegate(f"http://127.0.0.1:{port}"), time.perf_counter() - t0)
        bench.wait(timeout=a.seconds + 60)
        res = json.loads(bench_out.read_text())
        samples, shares = inclusive_shares(raw.read_text())
        top = top_inclusive(raw.read_text(), 30)
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    per_req = samples / (a.seconds * res["ok_req_s"])
    log.info("%s: %.1f req/s, %d GIL samples, %.4f per request", label, res["ok_req_s"], samples, per_req)
    return {"variant": label, "src": str(src), "target": a.target, "ok_req_s": res["ok_req_s"],
            "errors": res["errors"], "gil_samples": samples, "gil_samples_per_request": per_req,
            "inclusive_share": shares, "top_inclusive": top, "engine_phases": phases}  # fmt: skip


#: Functions whose inclusive share of the front-end's GIL samples each row reports.
WATCH = (
    "Request._get_form", "MultiPartParser.parse", "parse_small_multipart", "ThreadPoolExecutor.submit",
    "RequestResponseCycle.send", "solve_dependencies", "decode_image", "FaceOut.from_face", "RemoteEngine.submit",
    # the engine process (--target engine)
    "EngineHost._reader", "EngineHost._sender", "Connection.recv", "FrameReader.recv_many", "ForkingPickler.dumps",
    "EmbedStage.prepare", "EmbedStage.execute", "_StageRunner._front", "_StageRunner._back",
)  # fmt: skip


def top_inclusive(raw: str, n: int) -> list[tuple[str, float]]:
    """The ``n`` frames (``function (file:line)``) with the largest inclusive share of a ``py-spy -f raw`` file,
    leaving out the frames every sample of a thread shares (bootstrap, event loop)."""
    counts: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, num = line.rpartition(" ")
        if not stack or not num.isdigit():
            continue
        total += int(num)
        for frame in set(stack.split(";")):
            counts[frame] = counts.get(frame, 0) + int(num)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return [(f, round(c / total, 4)) for f, c in ranked if c < 0.9 * total][:n] if total else []


def inclusive_shares(raw: str) -> tuple[int, dict[str, float]]:
    """Total samples of a ``py-spy -f raw`` file, and the share of them with each :data:`WATCH` function on
    the stack."""
    total, hits = 0, dict.fromkeys(WATCH, 0)
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        total += int(n)
        frames = {f.split(" (", 1)[0] for f in stack.split(";")}
        for name in WATCH:
            if name in frames:
                hits[name] += int(n)
    return total, {k: round(v / total, 4) if total else 0.0 for k, v in hits.items()}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--py-spy", required=True)
    ap.add_argument("--variant", action="append", required=True, help="LABEL=SRC_DIR (repeat)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=int, default=12)
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--images-per-request", type=int, default=1, help="aligned crops per request")
    ap.add_argument("--target", choices=("front-end", "engine"), default="front-end", help="the process py-spy samples")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/frontend_gil_cpu.json"))
    a = ap.parse_args()
    variants = [(v.split("=", 1)[0], Path(v.split("=", 1)[1])) for v in a.variant]
    tmp = Path(tempfile.mkdtemp())
    crop = tmp / "crop.jpg"
    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(buf, "JPEG", quality=95)
    crop.write_bytes(buf.getvalue())
    rows = [run_variant(label, src, a, crop, tmp) for _ in range(a.rounds) for label, src in variants]
    summary = {
        label: float(np.median([r["gil_samples_per_request"] for r in rows if r["variant"] == label]))
        for label, _ in variants
    }
    env = env_record(**{k: str(v) for k, v in vars(a).items()})
    write_json(a.out, {"env": env, "command": " ".join(["python", *sys.argv]), "rows": rows,
                       "median_gil_samples_per_request": summary})  # fmt: skip


if __name__ == "__main__":
    main()
