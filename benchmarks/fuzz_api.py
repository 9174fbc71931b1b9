"""Fuzzing at scale: schema-driven requests to every route of a real server, and mutated decoder inputs.

Starts ``facegate serve``'s app (real models on the CPU, SQLite gallery in a temporary folder) on a free
loopback port in this process, then

1. sends schemathesis-generated requests (positive and negative) for every operation of the server's own
   OpenAPI document until at least ``--requests`` have been sent, and counts the statuses (the contract:
   no 5xx);
2. feeds ``--decoder-inputs`` random and mutated images to the decoders (the contract: an image or an
   input error, never another exception).

Writes one JSON (``--out``, default ``benchmarks/results/fuzz_api-cpu<cores>.json``).

    PYTHONPATH=src python benchmarks/fuzz_api.py --requests 10000 --decoder-inputs 100000
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, free_port, wait_ready, write_json
from facegate.config import Settings
from fuzz import FuzzReport, fuzz_api, fuzz_decoders

log = logging.getLogger("fuzz_api")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000, help="at least this many schema-driven requests")
    ap.add_argument("--decoder-inputs", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import uvicorn

    from facegate.api.app import create_app, uvicorn_config

    data = Path(tempfile.mkdtemp(prefix="facegate-fuzz-"))
    settings = Settings(device="cpu", host="127.0.0.1", port=free_port(), data_dir=data)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    wait_ready(url)
    schema = httpx.get(url + "/openapi.json").json()
    httpx.post(url + "/api/galleries", json={"name": "fuzz"})

    api = FuzzReport()
    per_op = 50
    seed = args.seed
    t0 = time.perf_counter()
    while api.requests < args.requests:  # rounds of new seeds until the count is reached
        r = fuzz_api(url, schema, examples_per_operation=per_op, seed=seed)
        api.requests += r.requests
        api.statuses.update(r.statuses)
        api.failures.extend(r.failures[: max(0, 20 - len(api.failures))])
        for k, v in r.per_operation.items():
            api.per_operation[k] = api.per_operation.get(k, 0) + v
        seed += 1
        log.warning("api: %d requests, %d 5xx", api.requests, api.server_errors)
    api.seconds = time.perf_counter() - t0
    alive = httpx.get(url + "/healthz").status_code == 200
    server.should_exit = True
    thread.join(timeout=60)

    dec = fuzz_decoders(args.decoder_inputs, seed=args.seed)
    crashes = sum(n for s, n in dec.statuses.items() if s.startswith("crash"))
    out = {
        "command": " ".join(["python", *sys.argv]),
        "env": env_record(requests=args.requests, decoder_inputs=args.decoder_inputs, seed=args.seed),
        "api": {**api.to_dict(), "server_alive_after": alive},
        "decoders": {**dec.to_dict(), "crashes": crashes},
    }
    path = args.out or Path(__file__).resolve().parent / "results" / f"fuzz_api-cpu{os.cpu_count()}.json"
    write_json(path, out)
    print(json.dumps({"api_requests": api.requests, "api_5xx": api.server_errors, "decoder_inputs": dec.requests,
                      "decoder_crashes": crashes, "out": str(path)}))  # fmt: skip


if __name__ == "__main__":
    main()
