"""Detector (YuNet) on one GPU: cold-start steps, first-call (planning) cost per new shape, steady-state time.

Why: the first end-to-end GPU run (benchmarks/results/http_gpu_run4.json) showed the detect stage busy 99.7 %
at 185 ms per batch of ~56 LFW photos, GPU utilisation 3 %, and 70–90 s to ``/readyz`` for every server.
This script times, in one process and in order:

* the cold-start steps: ``import torch``, CUDA init, model loads;
* per detector variant (layout × dtype × ``cudnn.benchmark``): the first call at each new input shape
  (what warm-up pays, and what serving pays for a shape warm-up missed), then the steady-state forward,
  decode+NMS (postprocess) and host preprocessing per batch, at 256×256 (LFW's padded size) and 640×640;
* torch's peak allocated memory after each variant.

  python benchmarks/detector_gpu.py --out benchmarks/results/detector_gpu.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()
import numpy as np
import torch

T_IMPORT = time.perf_counter() - T0
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time, env_record, wall_time, write_json

log = logging.getLogger("detector_gpu")


def timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, r


def recognizer_layouts(iters: int, out: Path, res: dict[str, Any]) -> list[dict[str, Any]]:
    """SFace fp16 (BN folded): first call per new batch shape and steady time, NCHW vs NHWC, eager and graphs."""
    from facegate.models.recognizer import build_recognizer
    from facegate.models.registry import SFACE
    from facegate.runtime.graphs import GraphedModule

    torch.backends.cudnn.benchmark = False
    rows: list[dict[str, Any]] = []
    for cl in (False, True):
        r = build_recognizer(SFACE, device="cuda", dtype=torch.float16, channels_last=cl).eval()
        r.backbone.fuse()
        row: dict[str, Any] = {"layout": "channels_last" if cl else "contiguous", "first_call_s": {}, "eager_ms": {}}
        for b in (1, 64):
            x = torch.randint(0, 255, (b, 112, 112, 3), dtype=torch.uint8, device="cuda")
            with torch.inference_mode():
                dt, _ = timed(lambda r=r, x=x: r(x))
                row["first_call_s"][f"b{b}"] = round(dt, 4)
                row["eager_ms"][f"b{b}"] = round(cuda_time(lambda r=r, x=x: r(x), iters=iters) * 1e3, 3)
        g = GraphedModule(r, (112, 112, 3), torch.uint8, buckets=(1, 64))
        dt, _ = timed(g.capture)
        row["graph_capture_s"] = round(dt, 3)
        with torch.inference_mode():
            for b in (1, 64):
                x = torch.randint(0, 255, (b, 112, 112, 3), dtype=torch.uint8, device="cuda")
                ms = cuda_time(lambda g=g, x=x: g(x), iters=iters * 5) * 1e3
                row[f"graphs_ms_b{b}"] = round(ms, 4)
                row[f"graphs_faces_s_b{b}"] = round(b / ms * 1e3, 1)
        log.info("sface fp16 %s", row)
        rows.append(row)
        write_json(out, res | {"recognizer": rows})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/detector_gpu.json"))
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", default="all", help="'all' or comma-separated indices into the variant list")
    o = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    batches = [int(b) for b in o.batches.split(",")]
    res: dict[str, Any] = {"benchmark": "detector_gpu", "cold": {"import_torch_s": round(T_IMPORT, 3)}, "variants": []}

    dt, _ = timed(lambda: torch.zeros(1, device="cuda"))
    res["cold"]["cuda_init_s"] = round(dt, 3)
    from facegate.models.detector import FaceDetector
    from facegate.models.yunet import load_yunet

    dt, _ = timed(lambda: load_yunet().to("cuda"))
    res["cold"]["load_yunet_s"] = round(dt, 3)
    res["env"] = env_record(batches=batches, iters=o.iters)
    rng = np.random.default_rng(0)
    imgs = {
        hw: [rng.integers(0, 255, (*hw, 3), dtype=np.uint8) for _ in range(max(batches))]
        for hw in ((250, 250), (640, 640))
    }

    variants = [
        ("fp32", "channels_last", False),
        ("fp32", "contiguous", False),
        ("fp16", "channels_last", False),
        ("fp16", "contiguous", False),
        ("fp32", "contiguous", True),
    ]
    if o.variants != "all":
        variants = [variants[int(i)] for i in o.variants.split(",")]
    for dtype_name, layout, bench in variants:
        torch.backends.cudnn.benchmark = bench
        dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype_name]
        det = FaceDetector(load_yunet(), device="cuda", dtype=dtype, channels_last=layout == "channels_last")
        torch.cuda.reset_peak_memory_stats()
        v: dict[str, Any] = {
            "dtype": dtype_name,
            "layout": layout,
            "cudnn_benchmark": bench,
            "first_call_s": {},
            "steady": {},
        }
        for hw, pool in imgs.items():
            for b in batches:
                key = f"{hw[0]}x{hw[1]}_b{b}"
                batch = det.preprocess(pool[:b])
                dt, raw = timed(lambda det=det, batch=batch: det.forward(batch))
                v["first_call_s"][key] = round(dt, 4)
                fwd = cuda_time(lambda det=det, batch=batch: det.forward(batch), iters=o.iters)
                post = wall_time(lambda det=det, batch=batch, raw=raw: det.postprocess(raw, batch), iters=o.iters)
                pre = wall_time(lambda det=det, b=b, pool=pool: det.preprocess(pool[:b]), iters=o.iters)
                v["steady"][key] = {
                    "forward_ms": round(fwd * 1e3, 3),
                    "postprocess_ms": round(post * 1e3, 3),
                    "preprocess_ms": round(pre * 1e3, 3),
                    "images_s_forward": round(b / fwd, 1),
                }
                log.info("%s %s bench=%s %s first %.3fs %s", dtype_name, layout, bench, key, dt, v["steady"][key])
                write_json(o.out, res | {"variants": [*res["variants"], v]})
        v["peak_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        v["reserved_mib"] = round(torch.cuda.memory_reserved() / 2**20, 1)
        res["variants"].append(v)
        write_json(o.out, res)
        det = None
        torch.cuda.empty_cache()
    res["recognizer"] = recognizer_layouts(o.iters, o.out, res)
    res["complete"] = True
    write_json(o.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
