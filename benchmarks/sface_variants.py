"""Which SFace fp16 execution is fastest at a given batch: memory format × compile mode.

python benchmarks/sface_variants.py --batches 1,64,256 --inductor --out benchmarks/results/sface_variants.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time, env_record, write_json
from facegate.engine.graphs import GraphedModule
from facegate.models.recognizer import build_recognizer
from facegate.models.registry import SFACE

log = logging.getLogger("sface_variants")


def make(channels_last: bool) -> torch.nn.Module:
    r = build_recognizer(SFACE, device="cuda", dtype=torch.float16, channels_last=channels_last)
    r.backbone.fuse()
    return r.eval()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--inductor-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/sface_variants.json"))
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    batches = [int(b) for b in a.batches.split(",")]
    rows = []
    ref = build_recognizer(SFACE, device="cuda", dtype=torch.float32).eval()
    variants = [("graphs", False), ("graphs", True)] + ([("inductor", True), ("inductor", False)] if a.inductor else [])
    for mode, cl in variants:
        t0 = time.perf_counter()
        g = GraphedModule(
            make(cl),
            (112, 112, 3),
            torch.uint8,
            buckets=batches,
            compile_mode=a.inductor_mode if mode == "inductor" else None,
        )
        g.capture()
        setup_s = time.perf_counter() - t0
        for b in batches:
            x = torch.randint(0, 256, (b, 112, 112, 3), dtype=torch.uint8, device="cuda")
            with torch.inference_mode():
                t = cuda_time(lambda g=g, x=x: g(x), iters=max(10, 2000 // b), warmup=5)
                t32 = cuda_time(lambda x=x: ref(x), iters=max(5, 500 // b), warmup=2)
                cos = float((g(x)[0] * ref(x)[0]).sum(1).min())
            row = {
                "mode": mode,
                "channels_last": cl,
                "batch": b,
                "ms": t * 1e3,
                "images_per_s": b / t,
                "eager_fp32_ms": t32 * 1e3,
                "speedup_vs_eager_fp32": t32 / t,
                "min_cosine_vs_fp32": cos,
                "setup_s": setup_s,
            }
            rows.append(row)
            log.info(
                "%s cl=%s b=%d %.3f ms %.0f img/s x%.2f vs eager fp32 (cos %.5f) setup %.0fs",
                mode,
                cl,
                b,
                row["ms"],
                row["images_per_s"],
                row["speedup_vs_eager_fp32"],
                cos,
                setup_s,
            )
        write_json(a.out, {"env": env_record(**{k: str(v) for k, v in vars(a).items()}), "rows": rows})


if __name__ == "__main__":
    main()
