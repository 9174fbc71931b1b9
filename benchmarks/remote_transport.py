"""Cost of the process model's transport: the same engine in-process and behind an engine process.

Both sides run :meth:`FaceService.build_tiny` (real YuNet, random-weight tiny recognizer) on the CPU with
the same settings; one asyncio loop submits ``--n`` requests at ``--concurrency`` to the ``embed`` stage
(one 112×112 crop) and to the ``detect`` stage (one 250×250 photo, LFW's size). The difference between the
two rows of a stage is what shared memory + the Unix socket + the extra process cost per request here.

  python benchmarks/remote_transport.py --out benchmarks/results/remote_transport_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.api.multiprocess import EngineProcess
from facegate.config import Settings
from facegate.service.faces import FaceService

log = logging.getLogger("remote_transport")


async def drive(service: FaceService, stage: str, payload: np.ndarray, n: int, concurrency: int) -> dict[str, Any]:
    lat: list[float] = []
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            t = time.perf_counter()
            await service.engine.submit(stage, payload)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    a = np.asarray(lat) * 1e3
    return {"req_s": round(n / wall, 1), "p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/remote_transport_cpu.json"))
    o = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    data_dir = Path(tempfile.mkdtemp(prefix="fg-transport-"))
    settings = Settings(device="cpu", data_dir=data_dir, max_wait_ms=1.0, cpu_chunk=64)
    rng = np.random.default_rng(0)
    payloads = {
        "embed": rng.integers(0, 255, (1, 112, 112, 3), dtype=np.uint8),
        "detect": rng.integers(0, 255, (250, 250, 3), dtype=np.uint8),
    }
    engine = EngineProcess(settings, tiny=True)
    engine.start()
    rows: list[dict[str, Any]] = []

    async def run_all() -> None:
        local = FaceService.build_tiny(settings)
        remote = FaceService.connect(settings, engine.address, engine.authkey)
        await local.start()
        await remote.start()
        for stage, payload in payloads.items():
            for c in [int(x) for x in o.concurrency.split(",")]:
                for name, svc in (("in-process", local), ("engine process", remote)):
                    await drive(svc, stage, payload, min(200, o.n), c)  # warm-up
                    r = {"stage": stage, "concurrency": c, "engine": name, **await drive(svc, stage, payload, o.n, c)}
                    log.info("%s", r)
                    rows.append(r)
        await local.stop()
        await remote.stop()

    try:
        asyncio.run(run_all())
    finally:
        engine.stop()
    write_json(o.out, {"benchmark": "remote_transport", "command": " ".join(sys.argv), "rows": rows,
                       "env": env_record(n=o.n, concurrency=o.concurrency)})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
