"""Where the engine's ``photo`` stage spends its time, without HTTP (issue #4: the stage bounds throughput).

The stage runs as the engine runs it (``FacePipeline.from_settings`` + ``warmup``, one CPU thread, the
serving process's GIL switch interval), on real JPEG bytes (LFW), for a few batch sizes:

* ``sequential``: ``prepare`` then ``execute``, one after the other: ms per batch of each;
* ``pipelined``: ``prepare`` on one thread and ``execute`` on another with one batch in between, as the
  engine's front and back threads do: photos/s, the stage's ceiling in the serving process;
* ``breakdown``: the same sequential loop with timing wrappers around the stage's steps (decode planning,
  nvJPEG, canvases, detector, face selection, warp, recognizer): wall ms per batch of each step;
* ``cprofile``: the top functions by own time over the sequential loop;
* ``gpu_kernels`` (``--gpu-kernels``): the device's kernel and copy time per batch over the sequential loop
  (``torch.profiler``), in total and for the top kernels: how much of ``execute`` the GPU itself needs.

Run it twice with different ``PYTHONPATH`` in one device call to A/B two versions of the code::

    python3 benchmarks/photo_profile.py --images .lfwB/lfw-deepfunneled --out $OUT/photo_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import logging
import pstats
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.config import Settings
from facegate.errors import FacegateError
from facegate.pipeline import photo as photo_mod
from facegate.pipeline.pipeline import FacePipeline, configure_cpu_threads

log = logging.getLogger("photo_profile")


def load_payloads(root: Path, n: int) -> list[np.ndarray]:
    files = sorted(root.rglob("*.jpg"))[:n]
    if len(files) < n:
        raise SystemExit(f"need {n} JPEGs under {root}, found {len(files)}")
    return [np.frombuffer(f.read_bytes(), np.uint8) for f in files]


def sequential(stage: Any, batches: list[list[np.ndarray]]) -> dict[str, float]:
    prep, exe, errors = [], [], 0
    for pl in batches:
        t0 = time.perf_counter()
        p = stage.prepare(pl)
        t1 = time.perf_counter()
        res = stage.execute(p)
        t2 = time.perf_counter()
        prep.append(t1 - t0)
        exe.append(t2 - t1)
        errors += sum(isinstance(r, FacegateError) for r in res)
    n = len(batches[0])
    return {
        "prepare_ms": round(1e3 * float(np.median(prep)), 3),
        "execute_ms": round(1e3 * float(np.median(exe)), 3),
        "prepare_us_per_photo": round(1e6 * float(np.median(prep)) / n, 1),
        "execute_us_per_photo": round(1e6 * float(np.median(exe)) / n, 1),
        "errors": errors,
    }


def pipelined(stage: Any, batches: list[list[np.ndarray]], seconds: float) -> dict[str, float]:
    """Two threads, one prepared batch in between (the engine's pipeline_depth 1)."""
    handoff: queue.Queue[Any] = queue.Queue(maxsize=1)
    stop = threading.Event()
    done = [0]

    def front() -> None:
        k = 0
        while not stop.is_set():
            handoff.put(stage.prepare(batches[k % len(batches)]))
            k += 1
        handoff.put(None)

    def back() -> None:
        while (p := handoff.get()) is not None:
            stage.execute(p)
            done[0] += len(p.decoded)

    threads = [threading.Thread(target=front), threading.Thread(target=back)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    return {"photos_per_s": round(done[0] / dt, 1), "seconds": round(dt, 2)}


class Timers:
    """Wall time of wrapped functions, per call name."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


def breakdown(pipe: FacePipeline, stage: Any, batches: list[list[np.ndarray]]) -> dict[str, Any]:
    """Wall ms per batch of the stage's steps (module-level names the stage calls, patched for the loop)."""
    timers = Timers()
    det = pipe.detector
    saved_mod = {name: getattr(photo_mod, name) for name in ("plan_decode", "run_decode", "prepare_photos", "_warp")}
    saved_pipe = {"recognize": pipe.recognize}
    # the names of the code under test (an older version, run for an A/B, may lack some)
    det_steps = ("run", "run_many", "preprocess_tensors", "_finish_all", "_finish_host")
    saved_det = {name: getattr(det, name) for name in det_steps if hasattr(det, name)}
    import facegate.pipeline.pipeline as pipeline_mod

    saved_select = pipeline_mod.select_faces
    try:
        for name, fn in saved_mod.items():
            setattr(photo_mod, name, timers.wrap(name, fn))
        pipe.recognize = timers.wrap("recognize", saved_pipe["recognize"])  # type: ignore[method-assign]
        for name, fn in saved_det.items():
            setattr(det, name, timers.wrap(f"detector.{name}", fn))
        pipeline_mod.select_faces = timers.wrap("select_faces", saved_select)
        for pl in batches:
            stage.execute(stage.prepare(pl))
    finally:
        for name, fn in saved_mod.items():
            setattr(photo_mod, name, fn)
        pipe.recognize = saved_pipe["recognize"]  # type: ignore[method-assign]
        for name in saved_det:
            delattr(det, name)
        pipeline_mod.select_faces = saved_select
    k = len(batches)
    return {
        name: {"ms_per_batch": round(1e3 * t / k, 3), "calls": timers.calls[name]} for name, t in timers.total.items()
    }


def profile(stage: Any, batches: list[list[np.ndarray]], top: int) -> list[dict[str, Any]]:
    prof = cProfile.Profile()
    prof.enable()
    for pl in batches:
        stage.execute(stage.prepare(pl))
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}:{fn}",
                "calls": nc,
                "tottime_ms_per_batch": round(1e3 * tt / len(batches), 3),
                "cumtime_ms_per_batch": round(1e3 * ct / len(batches), 3),
            }
        )
    rows.sort(key=lambda r: -r["tottime_ms_per_batch"])
    return rows[:top]


def gpu_kernels(stage: Any, batches: list[list[np.ndarray]], top: int) -> dict[str, Any]:
    """Device time per batch (kernels, memcpy, memset) over ``prepare`` + ``execute`` of ``batches``.

    ``device_ms_per_batch`` sums every device activity's duration (overlapping streams count twice), next to
    the loop's wall time: their ratio bounds how busy the device was.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for pl in batches:
            stage.execute(stage.prepare(pl))
        wall = time.perf_counter() - t0
    by_name: dict[str, float] = {}
    for ev in prof.events():
        kind = str(getattr(ev, "device_type", "")).rsplit(".", 1)[-1]
        if kind == "CUDA" and ev.device_time_total > 0 and not ev.cpu_children:
            by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.device_time_total / 1e3
    k = len(batches)
    total = sum(by_name.values())
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "wall_ms_per_batch": round(1e3 * wall / k, 3),
        "device_ms_per_batch": round(total / k, 3),
        "top": [{"name": n[:120], "ms_per_batch": round(t / k, 4)} for n, t in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=Path, required=True, help="folder with JPEGs (LFW layout)")
    ap.add_argument("--batches", default="16,54,128", help="batch sizes (photos per stage batch)")
    ap.add_argument("--iters", type=int, default=30, help="batches per measurement")
    ap.add_argument("--pipelined-s", type=float, default=4.0, help="seconds of the two-thread run per batch size")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--compile", default="graphs")
    ap.add_argument("--label", default="", help="stored with the result (e.g. the code version)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gpu-kernels", action="store_true", help="also measure device time per batch (torch.profiler)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings(device=args.device, precision=args.precision, compile=args.compile, gpu_preprocess="on")
    configure_cpu_threads(settings.cpu_threads, args.device)
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000.0)
    t0 = time.perf_counter()
    pipe = FacePipeline.from_settings(settings)
    pipe.warmup()
    startup = time.perf_counter() - t0
    stage = next(s for s in pipe.stages() if s.name == "photo")
    sizes = [int(b) for b in args.batches.split(",")]
    pool = load_payloads(args.images, max(sizes) * 4)
    result: dict[str, Any] = {
        "env": env_record(**vars(args) | {"images": str(args.images), "out": str(args.out)}),
        "label": args.label,
        "det_max_batch_pixels": pipe.det_max_batch_pixels,
        "startup_s": round(startup, 2),
        "warmup": pipe.warmup_report,
        "points": [],
    }
    for b in sizes:
        batches = [pool[(k * b) % len(pool) :][:b] for k in range(args.iters)]
        batches = [x if len(x) == b else pool[:b] for x in batches]
        stage.execute(stage.prepare(batches[0]))  # shapes of this batch size (detector bucket) seen once
        point = {"batch": b, "sequential": sequential(stage, batches)}
        point["pipelined"] = pipelined(stage, batches, args.pipelined_s)
        point["breakdown"] = breakdown(pipe, stage, batches)
        point["cprofile_top"] = profile(stage, batches[: max(5, args.iters // 3)], args.top)
        if args.gpu_kernels and args.device == "cuda":
            point["gpu_kernels"] = gpu_kernels(stage, batches[: max(5, args.iters // 3)], args.top)
        result["points"].append(point)
        log.info(
            "batch %d: prepare %.2f ms, execute %.2f ms; pipelined %.0f photos/s",
            b,
            point["sequential"]["prepare_ms"],
            point["sequential"]["execute_ms"],
            point["pipelined"]["photos_per_s"],
        )
        write_json(args.out, result)


if __name__ == "__main__":
    main()
