"""FP16 (or BF16) versus FP32 parity of the whole pipeline on LFW, in one run on one device.

Reports LFW 10-fold accuracy for both precisions and its delta, the mean (and min) embedding cosine
between the two precisions over all images, the Pearson r of the quality scores, and the share of
identical verification verdicts at the operating threshold (the model's calibrated FMR 1e-3 point).

  python benchmarks/parity_lfw.py --root $FACEGATE_LFW_ROOT --device cuda --precision fp16 \
      --out benchmarks/results/parity_lfw_fp16.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.config import Settings
from facegate.eval.lfw import embed_lfw, evaluate_scores, pair_images, pair_scores, read_pairs
from facegate.pipeline.pipeline import FacePipeline

log = logging.getLogger("parity_lfw")


def run_precision(root: Path, paths: list[str], device: str, precision: str, compile_mode: str, batch: int) -> tuple:
    s = Settings(device=device, precision=precision, compile=compile_mode)
    p = FacePipeline.from_settings(s)
    t0 = time.perf_counter()
    emb = embed_lfw(p, root, paths, batch_size=batch)
    return emb, time.perf_counter() - t0, p.operating.match_threshold


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--limit", type=int, default=0, help="use only the first N pairs (smoke runs)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/parity_lfw.json"))
    a = ap.parse_args()
    pairs = read_pairs(a.root)
    if a.limit:
        pairs = pairs[: a.limit]
    paths = pair_images(pairs)
    labels = np.array([p.same for p in pairs])
    folds = np.array([p.fold for p in pairs])
    e32, s32, thr = run_precision(a.root, paths, a.device, "fp32", "off", a.batch)
    elo, slo, _ = run_precision(a.root, paths, a.device, a.precision, a.compile, a.batch)
    ok = [k for k in paths if not (np.isnan(e32[k][0]).any() or np.isnan(elo[k][0]).any())]
    cos = np.array([float(np.dot(e32[k][0], elo[k][0])) for k in ok])
    q32 = np.array([e32[k][1] for k in ok])
    qlo = np.array([elo[k][1] for k in ok])
    sc32, sclo = pair_scores(pairs, e32), pair_scores(pairs, elo)
    r32, rlo = evaluate_scores(sc32, labels, folds), evaluate_scores(sclo, labels, folds)
    same_verdict = float(np.mean((sc32 >= thr) == (sclo >= thr)))
    res = {
        "pairs": len(pairs),
        "images": len(paths),
        "images_compared": len(ok),
        "operating_threshold": thr,
        "accuracy_fp32": r32.accuracy_mean,
        "accuracy_std_fp32": r32.accuracy_std,
        f"accuracy_{a.precision}": rlo.accuracy_mean,
        f"accuracy_std_{a.precision}": rlo.accuracy_std,
        "accuracy_delta": rlo.accuracy_mean - r32.accuracy_mean,
        "embedding_cosine_mean": float(cos.mean()),
        "embedding_cosine_min": float(cos.min()),
        "quality_pearson_r": float(np.corrcoef(q32, qlo)[0, 1]),
        "identical_verdicts": same_verdict,
        "tar_at_fmr1e-3_fp32": r32.tar_at_fmr,
        f"tar_at_fmr1e-3_{a.precision}": rlo.tar_at_fmr,
        "seconds_fp32": s32,
        f"seconds_{a.precision}": slo,
    }
    log.info("%s", res)
    write_json(a.out, {"env": env_record(**{k: str(v) for k, v in vars(a).items()}), **res})


if __name__ == "__main__":
    main()
