"""CPU smoke benchmark for CI: fails when cross-request batching stops paying off.

Two :class:`~facegate.service.faces.FaceService` instances in one process, identical except for
``batching`` (on: the engine forms batches of up to 64 within ``max_wait_ms``; off: every item runs alone),
each driven by ``concurrency`` (32) closed-loop asyncio clients calling ``face_aligned`` (the path of
``POST /api/embed`` with ``aligned=true``: engine ``embed`` stage → recognizer → quality gate). The two arms
run interleaved, ``rounds`` times each (on, off, on, off, ...), so a machine-wide slowdown hits both; the
verdict uses the median items/s of each arm.

Pass criteria (both must hold):

* ``median(on) / median(off) >= min_ratio`` (default **1.5**), items/s by wall clock;
* the batching arm's mean executed batch size ``>= min_batch`` (default **4**), and the off arm's is 1.

Why the *tiny* recognizer (``FaceService.build_tiny``: the real YuNet, the real engine/service/gate code,
a small random-weight recognizer): on this 2-core CPU the real SFace costs ≈15 ms per face at batch 1 and
≈11.6 ms per face at batch 4–16 (65 vs 86 faces/s, ≈1.3×), and the engine-level on/off ratio with it
swung between 0.75× and 1.21× over three rounds on this shared box: compute dominates and the noise is
larger than the effect, so no threshold on it could be both sensitive and stable. With the tiny model the
per-batch overhead that batching exists to amortise (thread hand-offs, Python dispatch, per-call
framework cost) dominates, as it does for the real model on a GPU.

Why 1.5×, measured on this shared 2-core box while other users loaded it (load average 3–6): with
batching working, 13 runs gave 2.3×–5.9× (median 2.9×); with both arms unbatched (the regression this
gate exists for; ``measure(on_batching=False)``), 6 runs gave 0.5×–1.49× (median 0.9×). 1.5× lies above
every broken run and 35 % below the slowest working one; a higher bar would fail healthy CI runs, a
lower one would pass broken ones. Torch runs 2 threads (``--threads``): with 1 thread the unbatched arm
gains more than the batched one and the ratio measured 1.8×–2.5×, closer to the bar. The batch-size
criterion is the noise-free half of the gate: a batcher that stopped forming batches fails it whatever the
timing noise did. Items per CPU-second of the process are recorded too (they were no steadier than wall
clock here, so they do not gate).

  python benchmarks/cpu_smoke.py --out benchmarks/results/cpu_smoke.json   # exit 1 when the gate fails
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from facegate.config import Settings
from facegate.service.faces import FaceService

log = logging.getLogger("cpu_smoke")

MIN_RATIO = 1.5
MIN_BATCH = 4.0


@dataclass
class SmokeResult:
    """Items/s per round of each arm, their medians and ratio, and the engine's mean batch sizes."""

    concurrency: int
    duration_s: float
    rounds: int
    threads: int
    model: str
    on_items_s: list[float] = field(default_factory=list)
    off_items_s: list[float] = field(default_factory=list)
    on_items_cpu_s: list[float] = field(default_factory=list)
    off_items_cpu_s: list[float] = field(default_factory=list)
    on_median: float = 0.0
    off_median: float = 0.0
    ratio: float = 0.0
    on_mean_batch: float = 0.0
    off_mean_batch: float = 0.0
    errors: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _closed_loop(svc: FaceService, crops: np.ndarray, concurrency: int, duration_s: float) -> tuple[int, int]:
    """``concurrency`` clients, each awaiting ``face_aligned`` back to back; returns (items, errors)."""
    done = errors = 0
    stop = time.perf_counter() + duration_s

    async def client(i: int) -> None:
        nonlocal done, errors
        j = i
        while time.perf_counter() < stop:
            try:
                face = await svc.face_aligned(crops[j % len(crops)])
                assert face.embedding.shape == (svc.spec.embedding_dim,)
                done += 1
            except Exception:
                errors += 1
            j += concurrency

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done, errors


async def measure_async(
    *,
    concurrency: int = 32,
    duration_s: float = 0.5,
    rounds: int = 6,
    tiny: bool = True,
    threads: int | None = None,
    on_batching: bool = True,
    max_wait_ms: float = 2.0,
) -> SmokeResult:
    """Run both arms interleaved and return the numbers (``on_batching=False`` simulates a regression)."""
    threads = threads or max(1, min(2, os.cpu_count() or 1))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t_all = time.perf_counter()
    crops = np.random.default_rng(0).integers(0, 256, (64, 112, 112, 3), dtype=np.uint8)
    services: dict[str, FaceService] = {}
    for arm, batching in (("on", on_batching), ("off", False)):
        engine = {"max_batch_size": 64 if batching else 1, "max_wait_ms": max_wait_ms}
        s = Settings(device="cpu", precision="fp32", model="sface-tiny" if tiny else "sface", engine=engine)
        svc = FaceService.build(s)
        await svc.start()
        services[arm] = svc
    res = SmokeResult(concurrency, duration_s, rounds, threads, "tiny" if tiny else services["on"].spec.name)
    try:
        for svc in services.values():  # warm-up: the first batches pay one-time allocation costs
            await _closed_loop(svc, crops, concurrency, min(0.3, duration_s))
        for _ in range(rounds):
            for arm, svc in services.items():
                t0, c0 = time.perf_counter(), time.process_time()
                n, err = await _closed_loop(svc, crops, concurrency, duration_s)
                rate = n / (time.perf_counter() - t0)
                per_cpu = n / max(time.process_time() - c0, 1e-9)
                (res.on_items_s if arm == "on" else res.off_items_s).append(round(rate, 1))
                (res.on_items_cpu_s if arm == "on" else res.off_items_cpu_s).append(round(per_cpu, 1))
                res.errors += err
        res.on_mean_batch = round(services["on"].stats.mean_batch_size("embed"), 2)
        res.off_mean_batch = round(services["off"].stats.mean_batch_size("embed"), 2)
    finally:
        for svc in services.values():
            await svc.stop()
        torch.set_num_threads(threads_before)
    res.on_median = statistics.median(res.on_items_s)
    res.off_median = statistics.median(res.off_items_s)
    res.ratio = round(res.on_median / res.off_median, 3) if res.off_median else 0.0
    res.seconds = round(time.perf_counter() - t_all, 2)
    return res


def measure(**kw: Any) -> SmokeResult:
    """Synchronous :func:`measure_async`."""
    return asyncio.run(measure_async(**kw))


def check(res: SmokeResult, *, min_ratio: float = MIN_RATIO, min_batch: float = MIN_BATCH) -> list[str]:
    """The gate: a list of failures (empty when batching pays off)."""
    failures = []
    if res.errors:
        failures.append(f"{res.errors} requests failed")
    if res.ratio < min_ratio:
        failures.append(
            f"batching on/off items/s ratio {res.ratio:.2f} < {min_ratio:.2f} "
            f"(on {res.on_items_s}, off {res.off_items_s})"
        )
    if res.on_mean_batch < min_batch:
        failures.append(f"mean batch size with batching {res.on_mean_batch:.2f} < {min_batch:.1f}")
    if res.off_mean_batch != 1.0:
        failures.append(f"mean batch size without batching is {res.off_mean_batch:.2f}, expected 1")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=0.5, help="seconds per arm per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default min(2, CPUs))")
    p.add_argument("--real", action="store_true", help="the real SFace instead of the tiny recognizer")
    p.add_argument("--min-ratio", type=float, default=MIN_RATIO)
    p.add_argument("--min-batch", type=float, default=MIN_BATCH)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    res = measure(concurrency=a.concurrency, duration_s=a.duration, rounds=a.rounds, tiny=not a.real, threads=a.threads)
    failures = check(res, min_ratio=a.min_ratio, min_batch=a.min_batch)
    report = {"result": res.to_dict(), "min_ratio": a.min_ratio, "min_batch": a.min_batch, "failures": failures}
    if a.out is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import env_record, write_json

        write_json(a.out, {**report, "env": env_record(**vars(a) | {"out": str(a.out)})})
    print(json.dumps(report, indent=2))  # CLI output
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
