"""What the garbage collector costs a serving process, with and without ``gc.freeze`` (Settings.gc_freeze).

Builds the real face service (default models, CPU), then allocates what the engine process allocates per
request (a ``concurrent.futures.Future``, as :meth:`Engine.enqueue`'s callers do) and records every
collection with ``gc.callbacks``: count and milliseconds per generation, and the wall time of the loop.
Then the same after :func:`facegate.service.faces.freeze_gc`. One process, one run, one JSON:

    python benchmarks/gc_pause.py --out benchmarks/results/gc_pause_cpu.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.config import Settings
from facegate.service.faces import FaceService, freeze_gc

log = logging.getLogger("gc_pause")


def measure(n: int) -> dict[str, Any]:
    """Allocate ``n`` futures (2,000 alive at a time); collections per generation and their time."""
    events: list[tuple[int, float]] = []
    t_start = [0.0]

    def cb(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            t_start[0] = time.perf_counter()
        else:
            events.append((int(info["generation"]), time.perf_counter() - t_start[0]))

    gc.callbacks.append(cb)
    alive: list[Any] = []
    t0 = time.perf_counter()
    try:
        for _ in range(n):
            alive.append(concurrent.futures.Future())
            if len(alive) >= 2000:
                alive.clear()
        wall = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(cb)
    per_gen = {}
    for g in (0, 1, 2):
        ts = [t for gen, t in events if gen == g]
        per_gen[str(g)] = {
            "collections": len(ts),
            "total_ms": round(1e3 * sum(ts), 2),
            "max_ms": round(1e3 * max(ts), 2) if ts else 0.0,
        }
    return {"futures": n, "wall_s": round(wall, 3), "us_per_future": round(1e6 * wall / n, 3), "by_generation": per_gen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    FaceService.build(Settings(device="cpu"))  # the models and their modules stay alive in this process
    objects = len(gc.get_objects())
    t = time.perf_counter()
    gc.collect(2)
    full_ms = 1e3 * (time.perf_counter() - t)
    before = measure(a.n)
    frozen = freeze_gc()
    after = measure(a.n)
    result = {
        "benchmark": "gc_pause",
        "command": " ".join(["python", *sys.argv]),
        "env": env_record(n=a.n, gc_threshold=list(gc.get_threshold())),
        "tracked_objects_after_startup": objects,
        "full_collection_ms_after_startup": round(full_ms, 2),
        "default_gc": before,
        "frozen_objects": frozen,
        "after_gc_freeze": after,
        "speedup": round(before["wall_s"] / after["wall_s"], 2),
    }
    write_json(a.out, result)
    log.info(
        "%d objects; full collection %.1f ms; %d futures: %.3f s default, %.3f s after gc.freeze (%.1fx)",
        objects, full_ms, a.n, before["wall_s"], after["wall_s"], result["speedup"],
    )  # fmt: skip


if __name__ == "__main__":
    main()
