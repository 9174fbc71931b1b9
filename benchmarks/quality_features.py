"""Extract quality-training features for a part of LFW (run on the GPU machine, or on CPU).

  python benchmarks/quality_features.py --images .lfwA/lfw-deepfunneled --device cuda --out-prefix $OUT/qf_A

Writes ``<prefix>_<i>.npz`` files of at most ``--rows-per-file`` rows (the device returns files of at
most 16 MiB each). The plan is clean + ``--random`` random degradations per image, plus every
degradation at every severity for every ``--progressive-every``-th image.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record
from facegate.config import Settings
from facegate.eval.features import extract, plan_variants
from facegate.pipeline.pipeline import FacePipeline

log = logging.getLogger("quality_features")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=Path, required=True, help="a folder named lfw-deepfunneled")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--random", type=int, default=2)
    ap.add_argument("--progressive-every", type=int, default=40)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--rows-per-file", type=int, default=5000)
    ap.add_argument("--out-prefix", type=Path, required=True)
    a = ap.parse_args()
    paths = sorted(str(p.relative_to(a.images)) for p in a.images.rglob("*.jpg"))
    if a.limit:
        paths = paths[: a.limit]
    plan = plan_variants(paths, a.random, a.progressive_every)
    p = FacePipeline.from_settings(Settings(device=a.device, precision="fp32"))
    t0 = time.perf_counter()
    cols = extract(p, a.images, paths, plan, batch_size=a.batch)
    secs = time.perf_counter() - t0
    n = len(cols["path"])
    log.info("%d rows from %d images in %.1f s; faces found: %.4f", n, len(paths), secs, cols["found"].mean())
    env = json.dumps(env_record(**{k: str(v) for k, v in vars(a).items()}, seconds=secs))
    for i, s in enumerate(range(0, n, a.rows_per_file)):
        part = {k: v[s : s + a.rows_per_file] for k, v in cols.items()}
        np.savez_compressed(f"{a.out_prefix}_{i}.npz", env=np.array(env), **part)


if __name__ == "__main__":
    main()
