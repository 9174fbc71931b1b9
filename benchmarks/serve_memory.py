"""Where a serving process's GPU memory and cold start go, step by step, one fresh process per variant.

For each variant (settings given as ``key=value`` pairs), a child process times ``import torch``, the
pipeline build and each warm-up step (:meth:`FacePipeline.warmup` reports seconds and torch memory per
step), then runs ``--load-batches`` batches of ``--batch`` LFW-sized photos through detect and embed (random
crops) and, when the pipeline has the engine's ``photo`` stage (``gpu_preprocess``), through that stage as
JPEG bytes. The photos are LFW's first ``--batch`` when ``FACEGATE_LFW_ROOT`` is set, else noise.
It reports torch's allocated / reserved / peak MiB and the driver's MiB for its own pid (NVML, what
nvidia-smi shows) after warm-up and after the load. A bare ``torch.cuda.init()`` child is measured first,
in the same run, as the baseline that "above the bare context" figures are measured from.

  python benchmarks/serve_memory.py --out benchmarks/results/serve_memory-h200.json \\
      --variant compile=graphs --variant compile=graphs,det_graphs=false --variant compile=off
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import numpy as np, torch
t_import = time.perf_counter() - t0
def nvml_mib():
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        return next(((p.usedGpuMemory or 0) / 2**20 for p in procs if p.pid == os.getpid()), None)
    except Exception:
        return None
spec = json.loads(sys.argv[1])
out = {"import_torch_s": round(t_import, 3)}
if spec.get("bare"):
    torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    out["driver_mib"] = nvml_mib()
    if spec.get("libraries"):  # what loading cuDNN and cuBLAS kernels costs, before any model
        steps = {}
        with torch.inference_mode():
            for dt in (torch.float32, torch.float16):
                x = torch.randn(8, 16, 64, 64, device="cuda", dtype=dt)
                w = torch.randn(16, 16, 3, 3, device="cuda", dtype=dt)
                torch.nn.functional.conv2d(x, w, padding=1); torch.cuda.synchronize()
                steps[f"cudnn_conv_{str(dt)[6:]}"] = nvml_mib()
                a = torch.randn(256, 256, device="cuda", dtype=dt)
                (a @ a).sum().item()
                steps[f"cublas_gemm_{str(dt)[6:]}"] = nvml_mib()
            torch.nn.functional.conv2d(x.contiguous(memory_format=torch.channels_last), w, padding=1)
            torch.cuda.synchronize()
            steps["cudnn_conv_fp16_nhwc"] = nvml_mib()
        # what CUDA graphs cost the driver by themselves: two captures of one convolution on a side stream
        side = torch.cuda.Stream()
        for k in (1, 2):
            with torch.cuda.stream(side), torch.inference_mode():
                torch.nn.functional.conv2d(x, w, padding=1)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side), torch.inference_mode():
                torch.nn.functional.conv2d(x, w, padding=1)
            g.replay(); torch.cuda.synchronize()
            steps[f"cuda_graph_{k}"] = nvml_mib()
            globals()[f"_graph_{k}"] = g
        out["steps_driver_mib"] = steps
        out["torch_reserved_mib"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    print(json.dumps(out)); sys.exit(0)
from facegate.config import Settings
from facegate.pipeline.pipeline import FacePipeline
t = time.perf_counter()
settings = Settings(**spec["settings"])
pipe = FacePipeline.from_settings(settings)
out["build_s"] = round(time.perf_counter() - t, 3)
out["model"] = pipe.spec.name
rec = getattr(pipe.recognizer, "module", pipe.recognizer)  # under a GraphedModule
plan = getattr(rec, "activation_plan", None)
if plan is not None:  # how a batch of spec["batch"] crops splits (Settings.activation_budget_mib)
    out["activation_split"] = dict(zip(("stages_in_sub_batches", "sub_batch"), plan.split(spec["batch"])))
cuda = pipe.device.type == "cuda"
def mem(tag):
    if cuda:
        torch.cuda.synchronize()
        out[tag] = {"allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
                    "reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
                    "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1), "driver_mib": nvml_mib()}
mem("after_build")
t = time.perf_counter()
out["warmup"] = pipe.warmup(driver_mib=nvml_mib)
out["warmup_s"] = round(time.perf_counter() - t, 3)
from facegate.runtime import graphs as _graphs
out["captures"] = list(_graphs.capture_records)
mem("after_warmup")
native = "cudaMallocAsync" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
out["allocator_backend"] = "native" if native else "cudaMallocAsync"
def pools_now():  # where the reserved memory sits: CUDA-graph pools vs the regular cache, by stream
    pools = {}
    for seg in torch.cuda.memory_snapshot():
        pool = seg.get("segment_pool_id", (0, 0))
        key = ("regular" if tuple(pool) == (0, 0) else "graph_pool") + f"/stream {seg.get('stream', 0)}"
        agg = pools.setdefault(key, {"segments": 0, "total_mib": 0.0, "allocated_mib": 0.0, "sizes_mib": []})
        agg["segments"] += 1
        agg["sizes_mib"].append(round(seg["total_size"] / 2**20, 1))
        agg["total_mib"] = round(agg["total_mib"] + seg["total_size"] / 2**20, 1)
        agg["allocated_mib"] = round(agg["allocated_mib"] + seg["allocated_size"] / 2**20, 1)
    return pools
if cuda and native:
    out["reserved_by_pool_after_warmup"] = pools_now()
if cuda:
    torch.cuda.reset_peak_memory_stats()  # after_load's peak is the peak under load
rng = np.random.default_rng(0)
# LFW photos when FACEGATE_LFW_ROOT is set (faces to align and embed), else noise
from pathlib import Path
import cv2
lfw = os.environ.get("FACEGATE_LFW_ROOT")
files = sorted(Path(lfw, "lfw-deepfunneled").glob("*/*.jpg"))[: spec["batch"]] if lfw else []
jpegs = [f.read_bytes() for f in files] or [
    cv2.imencode(".jpg", rng.integers(0, 255, (250, 250, 3), dtype=np.uint8))[1].tobytes()
    for _ in range(spec["batch"])]
jpegs = (jpegs * spec["batch"])[: spec["batch"]]
out["load_photos"] = "lfw" if files else "noise"
photos = [cv2.imdecode(np.frombuffer(j, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1].copy() for j in jpegs]
stage = None
if pipe.photo_limits is not None:  # the serving path of photo uploads (Settings.gpu_preprocess)
    from facegate.pipeline.photo import PhotoStage
    stage = PhotoStage(pipe, max_bytes=pipe.photo_limits[0], max_pixels=pipe.photo_limits[1])
def peak_of(name, fn):  # torch's peak allocation while fn runs, above what was allocated before (MiB)
    if cuda:
        torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    fn()
    if cuda:
        torch.cuda.synchronize()
        out["load_peaks_mib"][name] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
def load():  # the load, on this thread or (spec["load_thread"]) on another, as an engine's worker runs it
    out["load_peaks_mib"] = {}
    crops = rng.integers(0, 255, (spec["batch"], 112, 112, 3), dtype=np.uint8)
    peak_of("detect", lambda: pipe.detect(photos))
    peak_of("embed", lambda: pipe.embed(crops))
    if stage is not None:
        peak_of("photo_stage", lambda: stage.execute(stage.prepare([np.frombuffer(j, np.uint8) for j in jpegs])))
    if spec.get("embed_sizes"):  # embed batches of other sizes too (the engine pads them to its buckets)
        peak_of("embed_sizes", lambda: [pipe.embed(crops[:n]) for n in spec["embed_sizes"]])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(spec["load_batches"]):
        pipe.detect(photos)
        for n in spec.get("embed_sizes") or [spec["batch"]]:
            pipe.embed(rng.integers(0, 255, (n, 112, 112, 3), dtype=np.uint8))
        if stage is not None:
            stage.execute(stage.prepare([np.frombuffer(j, np.uint8) for j in jpegs]))
    out["load_s"] = round(time.perf_counter() - t, 3)
if spec.get("load_thread"):
    import threading
    worker = threading.Thread(target=load, name="load")
    worker.start(); worker.join()
else:
    load()
mem("after_load")
if cuda and native:
    out["reserved_by_pool_after_load"] = pools_now()
# steady-state timings (does a variant cost speed?): median of 50 calls each
def median_ms(fn, n=50):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return round(float(np.median(ts)) * 1e3, 3)
crops = rng.integers(0, 255, (spec["batch"], 112, 112, 3), dtype=np.uint8)
out["embed_batch_ms"] = median_ms(lambda: pipe.embed(crops))
out["detect_16_ms"] = median_ms(lambda: pipe.detect(photos[:16]))
if stage is not None:  # the photo stage: decode + detect + align + embed of spec["batch"] JPEGs
    payloads = [np.frombuffer(j, np.uint8) for j in jpegs]
    out["photo_batch_ms"] = median_ms(lambda: stage.execute(stage.prepare(payloads)), n=20)
mem("after_timing")
print(json.dumps(out))
"""


def run_child(spec: dict[str, Any], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    t = time.perf_counter()
    child_env = {**os.environ, "FACEGATE_LOG_LEVEL": "WARNING", **(env or {})}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                       timeout=timeout_s, env=child_env)  # fmt: skip
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_s"] = round(time.perf_counter() - t, 3)
    return res


def parse_variant(text: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``key=value`` pairs → (Settings fields, environment): UPPER-CASE keys (e.g. ``CUDNN_CONV_WSCAP_DBG``,
    PyTorch's cap on a cuDNN workspace in MiB) go to the child's environment. A list value is written
    ``[16|64]`` (commas separate the pairs)."""
    out: dict[str, Any] = {}
    env: dict[str, str] = {}
    for kv in filter(None, text.split(",")):
        k, v = kv.split("=", 1)
        if k.isupper():
            env[k] = v
        elif v.startswith("[") and v.endswith("]"):
            out[k] = [int(x) for x in v[1:-1].split("|") if x]
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out, env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=[], help="comma-separated Settings key=value pairs")
    p.add_argument(
        "--libraries-env",
        action="append",
        default=[],
        help="also measure the cuDNN/cuBLAS floor under this environment (comma-separated KEY=VALUE pairs)",
    )
    p.add_argument(
        "--load-thread", action="store_true", help="run the load on a thread other than warm-up's (as an engine does)"
    )
    p.add_argument(
        "--embed-sizes",
        default="",
        help="comma-separated crop counts: the load also embeds batches of these sizes (default: --batch only)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="fp16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--load-batches", type=int, default=30)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument(
        "--make-irse64",
        type=Path,
        default=None,
        help="write a random-weight IR-SE-64 RTS state_dict here first (memory does not depend on the weights); "
        "variants then name it with rts_checkpoint=PATH",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_memory-h200.json"))
    o = p.parse_args(argv)
    variants = o.variant or ["compile=graphs"]
    res: dict[str, Any] = {"benchmark": "serve_memory", "command": " ".join(sys.argv), "variants": []}
    if o.make_irse64 is not None and not o.make_irse64.exists():
        import torch

        from facegate.models.irse import IRSE64RTS

        torch.manual_seed(0)
        torch.save(IRSE64RTS().state_dict(), o.make_irse64)
    bare: float | None = None
    if o.device == "cuda":
        res["bare_context"] = run_child({"bare": True}, o.timeout)
        res["libraries"] = run_child({"bare": True, "libraries": True}, o.timeout)
        print("bare", res["bare_context"], "libraries", res["libraries"], flush=True)
        res["libraries_env"] = []
        for text in o.libraries_env:
            env = parse_variant(text)[1]
            res["libraries_env"].append({"env": env, **run_child({"bare": True, "libraries": True}, o.timeout, env)})
            print("libraries", env, res["libraries_env"][-1], flush=True)
        bare = res["bare_context"].get("driver_mib")
    for v in variants:
        fields, env = parse_variant(v)
        settings = {"device": o.device, "precision": o.precision, "max_batch_size": o.batch, **fields}
        sizes = [int(x) for x in o.embed_sizes.split(",") if x]
        child = {"settings": settings, "batch": o.batch, "load_batches": o.load_batches,
                 "load_thread": o.load_thread, "embed_sizes": sizes}  # fmt: skip
        row = {"variant": v, "settings": settings, "env": env, **run_child(child, o.timeout, env)}
        for tag in ("after_build", "after_warmup", "after_load", "after_timing"):
            if bare is not None and (row.get(tag) or {}).get("driver_mib") is not None:
                row[tag]["above_bare_mib"] = round(row[tag]["driver_mib"] - bare, 1)
        print(v, json.dumps(row), flush=True)
        res["variants"].append(row)
        res["env"] = env_record(variants=variants, batch=o.batch)
        write_json(o.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
