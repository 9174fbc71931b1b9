"""Which fp16 execution of a recognizer is fastest at a given batch: layout × BN folding × compile mode.

Model only: ``(N, 112, 112, 3) uint8`` crops already on the GPU in, normalised embedding and calibrated
quality out (normalisation, calibration and L2-normalisation included), as in ``models_gpu.py``. Each
variant is timed against eager fp32 at the same batch in the same process. Results are written after
every variant, so a run cut short by a time limit keeps what it finished. Named ``sface_variants.py``
until it learnt ``--model``.

Variants (all fp16 under per-batch CUDA graphs except ``eager-fp32``):

* ``graphs``: BatchNorm folded (``backbone.fuse()``), channels_last, eager cuDNN/cuBLAS kernels captured
  (what ``--compile graphs`` serves); ``graphs-nchw``: the same in NCHW; ``graphs-unfused``: without
  folding.
* ``inductor``: ``torch.compile`` (default mode) first, then capture; ``inductor-max-autotune``: the
  ``max-autotune-no-cudagraphs`` mode (Triton templates benchmarked against cuDNN/cuBLAS per shape).
  ``--freezing`` and ``--conv1x1-mm`` add the Inductor options ``freezing`` and
  ``conv_1x1_as_mm`` (both together are what ``compile=inductor`` serves with). The compile cache is
  ``TORCHINDUCTOR_CACHE_DIR``; the JSON says how many files it held at the start (0 = a cold cache).

python benchmarks/compile_variants.py --model irse64 --batches 1,64 --variants graphs,graphs-unfused \\
    --out benchmarks/results/compile_variants_irse64.json
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time, env_record, write_json
from facegate.models.irse import IRSE64RTS
from facegate.models.recognizer import Recognizer, build_recognizer
from facegate.models.registry import IRSE64_RTS, SFACE
from facegate.runtime.graphs import GraphedModule

log = logging.getLogger("compile_variants")
VARIANTS = ("graphs", "graphs-nchw", "graphs-unfused", "inductor", "inductor-max-autotune")


def make(model: str, dtype: torch.dtype, *, channels_last: bool, fuse: bool, ckpt: Path) -> Recognizer:
    """A recognizer on CUDA in ``dtype``; IR-SE-64 gets seeded random weights (saved once to ``ckpt``)."""
    if model == "sface":
        r = build_recognizer(SFACE, device="cuda", dtype=dtype, channels_last=channels_last)
    else:
        if not ckpt.exists():
            torch.manual_seed(0)
            torch.save(IRSE64RTS().state_dict(), ckpt)
        r = build_recognizer(IRSE64_RTS, checkpoint=ckpt, device="cuda", dtype=dtype, channels_last=channels_last)
    r = r.eval()
    if fuse:
        r.backbone.fuse()
    return r


def cache_files() -> int:
    d = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return sum(len(f) for _, _, f in os.walk(d)) if d and Path(d).is_dir() else -1


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("sface", "irse64"), default="sface")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--variants", default="graphs,graphs-nchw", help=f"comma list of {VARIANTS}")
    ap.add_argument("--freezing", action="store_true", help="Inductor option freezing=True")
    ap.add_argument("--conv1x1-mm", action="store_true", help="Inductor option conv_1x1_as_mm=True")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compile_variants.json"))
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}")
    torch.backends.cudnn.benchmark = True
    options = {k: True for k, on in (("freezing", a.freezing), ("conv_1x1_as_mm", a.conv1x1_mm)) if on}
    batches = [int(b) for b in a.batches.split(",")]
    ckpt = Path(tempfile.mkdtemp()) / "irse64_random.pt"
    env = env_record(**{k: str(v) for k, v in vars(a).items()}, inductor_cache_files_at_start=cache_files())
    ref = make(a.model, torch.float32, channels_last=False, fuse=False, ckpt=ckpt)
    rows: list[dict] = []
    for variant in variants:
        t0 = time.perf_counter()
        m = make(
            a.model,
            torch.float16,
            channels_last=variant != "graphs-nchw",
            fuse=variant != "graphs-unfused",
            ckpt=ckpt,
        )
        mode = {"inductor": "default", "inductor-max-autotune": "max-autotune-no-cudagraphs"}.get(variant)
        g = GraphedModule(
            m, (112, 112, 3), torch.uint8, buckets=batches, compile_mode=mode, compile_options=options if mode else None
        )
        g.capture()
        setup_s = time.perf_counter() - t0
        for b in batches:
            x = torch.randint(0, 256, (b, 112, 112, 3), dtype=torch.uint8, device="cuda")
            with torch.inference_mode():
                t = cuda_time(lambda g=g, x=x: g(x), iters=max(20, 2000 // b), warmup=5)
                t32 = cuda_time(lambda x=x: ref(x), iters=max(5, 500 // b), warmup=2)
                out, out32 = g(x), ref(x)
            row = {
                "model": a.model,
                "variant": variant,
                "batch": b,
                "ms": t * 1e3,
                "images_per_s": b / t,
                "eager_fp32_ms": t32 * 1e3,
                "speedup_vs_eager_fp32": t32 / t,
                "min_cosine_vs_fp32": float((out[0] * out32[0]).sum(1).min()),
                "max_quality_diff_vs_fp32": float((out[1] - out32[1]).abs().max()),
                "setup_s": setup_s,
                "capture_s": g.capture_seconds.get(b),
            }
            rows.append(row)
            log.info(
                "%s %s b=%d %.3f ms %.0f img/s x%.2f vs eager fp32 (cos %.5f) setup %.0fs",
                a.model,
                variant,
                b,
                row["ms"],
                row["images_per_s"],
                row["speedup_vs_eager_fp32"],
                row["min_cosine_vs_fp32"],
                setup_s,
            )
            write_json(a.out, {"env": env, "rows": rows})
        del g, m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
