"""The ``low_confidence`` and ``out_of_distribution`` reasons on labelled strata of LFW photos.

Each sampled pairs.txt photo is run through the CPU pipeline (its largest face) clean, with sensor-like grain
(``facegate.eval.degrade.noise``, severity 1-5) and as a colour negative. Positives: ``low_confidence`` — the
grain at severity ≥ 3; ``out_of_distribution`` — the negatives (a face unlike the photos the model knows).
Negatives: the clean faces. ``low_confidence``'s limit on the detector score is chosen on nine identity folds
and measured on the tenth, by the rule of ``facegate.eval.quality.reasons_study`` (at most 0.2 % of clean faces,
the most lenient limit reaching 85 % of positives); it is also measured at the shipped ``min_det_score``.
``out_of_distribution`` fires below the quality gate, so it is measured at the shipped verify gate. A photo whose
face is not found counts as a failure to acquire, not as a positive.

    python benchmarks/quality_strata.py --photos 1000
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, pair_photo_sample
from facegate.config import QualitySettings, Settings
from facegate.errors import NoFaceError
from facegate.eval.degrade import noise, path_rng
from facegate.eval.quality import _fires, _pr, choose_limit
from facegate.io.decode import decode_image
from facegate.pipeline.pipeline import FacePipeline

log = logging.getLogger("quality_strata")
#: variant name → the photo it makes from an ``(H, W, 3) uint8`` RGB photo
VARIANTS = {
    "clean": lambda img, rng: img,
    **{f"grain{s}": (lambda img, rng, s=s: noise(img, s, rng)) for s in range(1, 6)},
    "negative": lambda img, rng: 255 - img,
}


def held_out(pos: np.ndarray, pos_fold: np.ndarray, neg: np.ndarray, neg_fold: np.ndarray) -> dict[str, object]:
    """Precision and recall of a detector-score limit (fires below it) chosen on nine folds, pooled over the
    tenths; and the limit chosen on all folds."""
    pos_fired, neg_fired, limits = [], [], []
    for f in range(10):
        lim = choose_limit(pos[pos_fold != f], neg[neg_fold != f], -1, max_clean=0.002, min_recall=0.85)
        limits.append(round(lim, 4))
        pos_fired.append(_fires(pos[pos_fold == f], lim, -1))
        neg_fired.append(_fires(neg[neg_fold == f], lim, -1))
    return {
        **_pr(np.concatenate(pos_fired), np.concatenate(neg_fired)),
        "fold_limits": limits,
        "limit_all_folds": choose_limit(pos, neg, -1, max_clean=0.002, min_recall=0.85),
    }


def at_limit(pos: np.ndarray, neg: np.ndarray, limit: float) -> dict[str, object]:
    """Precision and recall of a limit (fires below it)."""
    return {"limit": limit, **_pr(pos < limit, neg < limit)}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lfw", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "../shared/data/lfw")))
    ap.add_argument("--photos", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_strata-cpu2.json"))
    a = ap.parse_args()
    folds, paths = pair_photo_sample(a.lfw, a.photos)
    pipe = FacePipeline.from_settings(Settings(device="cpu"))
    gate = float(pipe.operating.quality_threshold)
    rows: list[tuple[str, str, bool, float, float, tuple[str, ...]]] = []
    t0 = time.perf_counter()
    for n, q in enumerate(paths, 1):
        img = decode_image((a.lfw / "lfw-deepfunneled" / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
        rng = path_rng(q, 41)
        for name, make in VARIANTS.items():
            try:
                face = pipe.faces([np.ascontiguousarray(make(img, rng))])[0][0]
            except NoFaceError:
                rows.append((q, name, False, np.nan, np.nan, ()))
                continue
            assert face.detection is not None
            codes = tuple(r.code for r in face.quality.reasons)
            rows.append((q, name, True, face.detection.score, face.quality.score, codes))
        if n % 100 == 0:
            log.info("%d/%d photos, %.0f s", n, len(paths), time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    ident = np.array([r[0].split("/")[0] for r in rows])
    var = np.array([r[1] for r in rows])
    found = np.array([r[2] for r in rows])
    det = np.array([r[3] for r in rows], np.float64)
    qual = np.array([r[4] for r in rows], np.float64)
    fold = np.array([folds[i] for i in ident])
    clean = found & (var == "clean")
    grain = found & np.isin(var, ["grain3", "grain4", "grain5"])
    neg = found & (var == "negative")
    shipped_det = QualitySettings().min_det_score
    other = {
        name: {
            "faces": int((var == name).sum()),
            "found": float(found[var == name].mean()),
            "det_score_median": float(np.nanmedian(det[var == name])) if (found & (var == name)).any() else None,
            "quality_median": float(np.nanmedian(qual[var == name])) if (found & (var == name)).any() else None,
            "reasons": {
                code: int(sum(code in r[5] for r, v in zip(rows, var, strict=True) if v == name))
                for code in sorted({c for r in rows for c in r[5]})
            },
        }
        for name in VARIANTS
    }
    rep = {
        "command": "python benchmarks/quality_strata.py " + " ".join(sys.argv[1:]),
        "photos": len(paths),
        "verify_gate": gate,
        "variants": other,
        "low_confidence": {
            "positives": "grain at severity 3-5, found",
            "held_out": held_out(det[grain], fold[grain], det[clean], fold[clean]),
            "shipped": at_limit(det[grain], det[clean], shipped_det),
            "detector_score_threshold": float(Settings().detector.score_threshold),
        },
        "out_of_distribution": {
            "positives": "colour negatives, found",
            "shipped": at_limit(qual[neg], qual[clean], gate),
        },
        "clean_det_score_quantiles": {str(p): float(np.quantile(det[clean], p)) for p in (0.0, 0.002, 0.01, 0.5)},
        "env": env_record(photos=a.photos, seconds=round(seconds, 1)),
    }
    a.out.write_text(json.dumps(rep, indent=1))
    for code in ("low_confidence", "out_of_distribution"):
        print(code, json.dumps({k: v for k, v in rep[code].items() if k != "positives"}))


if __name__ == "__main__":
    main()
