"""Model-only throughput on one GPU: images/s against batch size for each engine mode.

Modes (all take ``(N,112,112,3) uint8`` crops already on the device, so preprocessing is inside):
  eager-fp32  reference; eager-fp16 and eager-bf16 with channels_last;
  graphs-fp16 CUDA graphs over the eager fp16 kernels (BN folded into convs for SFace);
  inductor-fp16 torch.compile (Inductor) + CUDA graphs, at a few batch sizes only (compile is slow).
Reports images/s, ms per batch, TFLOP/s (FLOPs counted with FlopCounterMode) against the measured fp16
matmul peak of the card, and the peak allocated memory. IR-SE-64 runs with random weights (no RTS
checkpoint is reachable); throughput does not depend on weight values.

  python benchmarks/models_gpu.py --out benchmarks/results/models_gpu-h200.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time, env_record, measured_peak_tflops, write_json
from facegate.models.irse import IRSE64RTS
from facegate.models.recognizer import build_recognizer
from facegate.models.registry import IRSE64_RTS, SFACE
from facegate.runtime.graphs import GraphedModule

log = logging.getLogger("models_gpu")


def make(name: str, dtype: torch.dtype, *, channels_last: bool, fuse: bool, ckpt_dir: Path) -> torch.nn.Module:
    if name == "sface":
        r = build_recognizer(SFACE, device="cuda", dtype=torch.float32, channels_last=channels_last)
        if fuse:
            r.backbone.fuse()
    else:
        path = ckpt_dir / "irse64_random.pt"
        if not path.exists():
            torch.manual_seed(0)
            torch.save(IRSE64RTS().state_dict(), path)
        r = build_recognizer(
            IRSE64_RTS, checkpoint=path, device="cuda", dtype=torch.float32, channels_last=channels_last
        )
    r = r.to(dtype=dtype) if dtype != torch.float32 else r
    # keep normalisation buffers / calibration in fp32 (Recognizer casts inputs itself)
    r.mean.data = r.mean.data.float()
    r.std.data = r.std.data.float()
    r.calibration.float()
    if channels_last:
        r = r.to(memory_format=torch.channels_last)
    return r.eval()


def flops_per_face(model: torch.nn.Module) -> float:
    x = torch.randint(0, 255, (8, 112, 112, 3), dtype=torch.uint8, device="cuda")
    with FlopCounterMode(display=False) as fc, torch.inference_mode():
        model(x)
    return fc.get_total_flops() / 8


def run(args: argparse.Namespace) -> dict:
    torch.backends.cudnn.benchmark = True
    peak = measured_peak_tflops(torch.float16)
    log.info("measured fp16 dense matmul peak: %.0f TFLOP/s", peak)
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    tmp = Path(tempfile.mkdtemp())
    for name in args.models.split(","):
        fp32 = make(name, torch.float32, channels_last=False, fuse=False, ckpt_dir=tmp)
        gflop = flops_per_face(fp32) / 1e9
        log.info("%s: %.3f GFLOP per face", name, gflop)
        modes = {
            "eager-fp32": fp32,
            "eager-fp16": make(name, torch.float16, channels_last=True, fuse=False, ckpt_dir=tmp),
            "eager-bf16": make(name, torch.bfloat16, channels_last=True, fuse=False, ckpt_dir=tmp),
        }
        fp16_fused = make(name, torch.float16, channels_last=True, fuse=True, ckpt_dir=tmp)
        t0 = time.perf_counter()
        graphed = GraphedModule(fp16_fused, (112, 112, 3), torch.uint8, buckets=batches)
        graphed.capture()
        graphs_s = time.perf_counter() - t0
        modes["graphs-fp16"] = graphed
        for mode, model in modes.items():
            for b in batches:
                x = torch.randint(0, 255, (b, 112, 112, 3), dtype=torch.uint8, device="cuda")
                torch.cuda.reset_peak_memory_stats()
                with torch.inference_mode():
                    iters = max(5, min(200, int(2000 / b)))
                    t = cuda_time(lambda m=model, x=x: m(x), iters=iters, warmup=3)
                row = {
                    "model": name,
                    "mode": mode,
                    "batch": b,
                    "ms": t * 1e3,
                    "images_per_s": b / t,
                    "tflops": gflop * b / t / 1e3,
                    "peak_fraction": gflop * b / t / 1e3 / peak,
                    "peak_alloc_mib": torch.cuda.max_memory_allocated() / 2**20,
                }
                results.append(row)
                log.info(
                    "%-7s %-12s b=%-5d %9.3f ms %10.0f img/s %6.1f TFLOP/s",
                    name,
                    mode,
                    b,
                    row["ms"],
                    row["images_per_s"],
                    row["tflops"],
                )
        # inductor at a few batch sizes (compile time recorded)
        if args.inductor:
            for b in [int(v) for v in args.inductor_batches.split(",")]:
                m = make(name, torch.float16, channels_last=True, fuse=True, ckpt_dir=tmp)
                t0 = time.perf_counter()
                g = GraphedModule(m, (112, 112, 3), torch.uint8, buckets=[b], compile_mode=args.inductor_mode)
                g.capture()
                compile_s = time.perf_counter() - t0
                x = torch.randint(0, 255, (b, 112, 112, 3), dtype=torch.uint8, device="cuda")
                with torch.inference_mode():
                    t = cuda_time(lambda g=g, x=x: g(x), iters=max(5, min(200, int(2000 / b))), warmup=3)
                row = {
                    "model": name,
                    "mode": "inductor-fp16",
                    "batch": b,
                    "ms": t * 1e3,
                    "images_per_s": b / t,
                    "tflops": gflop * b / t / 1e3,
                    "peak_fraction": gflop * b / t / 1e3 / peak,
                    "compile_s": compile_s,
                }
                results.append(row)
                log.info(
                    "%-7s inductor-fp16 b=%-5d %9.3f ms %10.0f img/s (compile %.0f s)",
                    name,
                    b,
                    row["ms"],
                    row["images_per_s"],
                    compile_s,
                )
        results.append({"model": name, "gflop_per_face": gflop, "graphs_capture_s": graphs_s})
        del modes, graphed, fp16_fused
        torch.cuda.empty_cache()
    return {"peak_fp16_tflops": peak, "results": results}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="sface,irse64")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--inductor-batches", default="1,64")
    ap.add_argument("--inductor-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/models_gpu-h200.json"))
    args = ap.parse_args()
    res = run(args)
    write_json(args.out, {"env": env_record(**vars(args) | {"out": str(args.out)}), **res})


if __name__ == "__main__":
    main()
