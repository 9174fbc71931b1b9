"""CPU per request of the load generator's two transports, against one trivial local server, in one run.

The server (a uvicorn subprocess) parses the multipart form and answers a 128-float JSON body, like
facegate's ``/api/embed``; the client sends ``embed_aligned`` requests with one 112×112 JPEG crop.
``client_cpu_ms_per_req`` is this process's CPU time over the requests it completed.

python benchmarks/client_cost.py --out benchmarks/results/client_cost_cpu.json
"""

from __future__ import annotations

import argparse
import io
import logging
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.bench.http import TRANSPORTS, run_http_bench

log = logging.getLogger("client_cost")
APP = textwrap.dedent(
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    app = FastAPI()
    @app.post("/api/embed")
    async def embed(request: Request):
        form = await request.form()
        return JSONResponse({"model": "fake", "results": [{"index": 0, "faces": [{"embedding": [0.1] * 128}]}]})
    @app.get("/readyz")
    async def readyz():
        return {"status": "ready"}
    """
)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/client_cost_cpu.json"))
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(buf, "JPEG", quality=95)
    crop = buf.getvalue()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "fakeapp.py").write_text(APP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "uvicorn", "fakeapp:app", "--port", str(port), "--log-level", "warning"]
    srv = subprocess.Popen([*argv, "--no-access-log"], cwd=tmp)
    rows = []
    try:
        url = f"http://127.0.0.1:{port}"
        for r in range(a.rounds):
            for t in TRANSPORTS:
                c0 = time.process_time()
                res = run_http_bench(
                    url, kind="embed_aligned", images=[crop], concurrency=a.concurrency, n_requests=a.requests,
                    warmup=50, wait_ready_s=30, transport=t,
                )  # fmt: skip
                cpu = time.process_time() - c0
                row = {"round": r, "transport": t, "n": res.n, "n_ok": res.n_ok, "req_s": res.req_s,
                       "client_cpu_ms_per_req": cpu / (res.n + 50) * 1e3, "client": res.settings["client"]}  # fmt: skip
                rows.append(row)
                log.info("%s: %.3f ms CPU per request, %.0f req/s", t, row["client_cpu_ms_per_req"], res.req_s)
    finally:
        srv.terminate()
        srv.wait(timeout=10)
    summary = {
        t: float(np.median([r["client_cpu_ms_per_req"] for r in rows if r["transport"] == t])) for t in TRANSPORTS
    }
    env = env_record(**{k: str(v) for k, v in vars(a).items()})
    write_json(a.out, {"env": env, "rows": rows, "median_client_cpu_ms_per_req": summary})


if __name__ == "__main__":
    main()
