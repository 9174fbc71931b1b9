"""The ``low_confidence`` and ``out_of_distribution`` reasons on labelled strata of LFW photos.

Each sampled pairs.txt photo is run through the CPU pipeline (its largest face) clean and as each of
``--variants``: sensor-like grain (``facegate.eval.degrade.noise``, severity 1-5), a colour negative, the face
partly out of the frame (``cut``: 10-50 % of the clean face box's width cut off, severity 1-5) or heavy JPEG
compression (``facegate.eval.degrade.jpeg``, severity 1-5). Positives: ``low_confidence`` — the ``--positives``
families at severity ≥ 3; ``out_of_distribution`` — the negatives (a face unlike the photos the model knows).
Negatives: the clean faces. ``low_confidence``'s limit on the detector score is chosen on nine identity folds
and measured on the tenth, by the rule of ``quality_eval.reasons_study`` (at most 0.2 % of clean faces,
the most lenient limit reaching 85 % of positives); it is also measured at the shipped ``min_det_score``.
``out_of_distribution`` fires below the quality gate, so it is measured at the shipped verify gate. A photo whose
face is not found counts as a failure to acquire, not as a positive. docs/quality.md takes ``low_confidence``'s
strata and its shipped rule from ``benchmarks/quality_lowconf.py``, and the colour negatives from here.

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
from facegate.eval.degrade import jpeg, noise, path_rng
from facegate.io.decode import decode_image
from facegate.pipeline.pipeline import FacePipeline
from quality_eval import choose_limit, past_limit, precision_recall

log = logging.getLogger("quality_strata")
#: the share of the face box's width a ``cut`` variant leaves outside the frame, by severity
CUT_SHARE = (0.1, 0.2, 0.3, 0.4, 0.5)


def frame_cut(img: np.ndarray, box: np.ndarray, share: float, rng: np.random.Generator) -> np.ndarray:
    """``img`` cropped at a vertical line through the face ``box`` ``(4,)`` (x0, y0, x1, y1), so that ``share`` of
    its width lies outside the frame, on a side drawn from ``rng``: a face partly out of the picture."""
    x0, x1 = float(box[0]), float(box[2])
    if rng.random() < 0.5:
        return np.ascontiguousarray(img[:, max(0, round(x0 + share * (x1 - x0))) :])
    return np.ascontiguousarray(img[:, : max(1, round(x1 - share * (x1 - x0)))])


#: variant name → the photo it makes from an ``(H, W, 3) uint8`` RGB photo, its rng and the clean face's box
VARIANTS = {
    "clean": lambda img, rng, box: img,
    **{f"grain{s}": (lambda img, rng, box, s=s: noise(img, s, rng)) for s in range(1, 6)},
    "negative": lambda img, rng, box: 255 - img,
    **{f"cut{s}": (lambda img, rng, box, s=s: frame_cut(img, box, CUT_SHARE[s - 1], rng)) for s in range(1, 6)},
    **{f"jpeg{s}": (lambda img, rng, box, s=s: jpeg(img, s, rng)) for s in range(1, 6)},
}
DEFAULT_VARIANTS = ("clean", *(f"grain{s}" for s in range(1, 6)), "negative")


def held_out(pos: np.ndarray, pos_fold: np.ndarray, neg: np.ndarray, neg_fold: np.ndarray) -> dict[str, object]:
    """Precision and recall of a detector-score limit (fires below it) chosen on nine folds, pooled over the
    tenths; and the limit chosen on all folds."""
    pos_fired, neg_fired, limits = [], [], []
    for f in range(10):
        lim = choose_limit(pos[pos_fold != f], neg[neg_fold != f], -1, max_clean=0.002, min_recall=0.85)
        limits.append(round(lim, 4))
        pos_fired.append(past_limit(pos[pos_fold == f], lim, -1))
        neg_fired.append(past_limit(neg[neg_fold == f], lim, -1))
    return {
        **precision_recall(np.concatenate(pos_fired), np.concatenate(neg_fired)),
        "fold_limits": limits,
        "limit_all_folds": choose_limit(pos, neg, -1, max_clean=0.002, min_recall=0.85),
    }


def at_limit(pos: np.ndarray, neg: np.ndarray, limit: float) -> dict[str, object]:
    """Precision and recall of a limit (fires below it)."""
    return {"limit": limit, **precision_recall(pos < limit, neg < limit)}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lfw", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "../shared/data/lfw")))
    ap.add_argument("--photos", type=int, default=1000)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS))
    what = "low_confidence's positives: each family at severity 3-5 (the first is the JSON's low_confidence)"
    ap.add_argument("--positives", nargs="+", default=["grain"], help=what)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_strata-cpu2.json"))
    a = ap.parse_args()
    if "clean" not in a.variants:
        ap.error("--variants needs clean (the negatives, and the face box of the cut variants)")
    variants = {k: VARIANTS[k] for k in ["clean", *(v for v in a.variants if v != "clean")]}
    folds, paths = pair_photo_sample(a.lfw, a.photos)
    pipe = FacePipeline.from_settings(Settings(device="cpu"))
    gate = float(pipe.operating.quality_threshold)
    rows: list[tuple[str, str, bool, float, float, tuple[str, ...]]] = []
    t0 = time.perf_counter()
    for n, q in enumerate(paths, 1):
        img = decode_image((a.lfw / "lfw-deepfunneled" / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
        rng = path_rng(q, 41)
        box = None
        for name, make in variants.items():
            if name != "clean" and box is None:  # the clean face was not found: nothing to cut around
                rows.append((q, name, False, np.nan, np.nan, ()))
                continue
            try:
                face = pipe.faces([np.ascontiguousarray(make(img, rng, box))])[0][0]
            except NoFaceError:
                rows.append((q, name, False, np.nan, np.nan, ()))
                continue
            assert face.detection is not None
            if name == "clean":
                box = np.asarray(face.detection.box, np.float64)
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
    neg = found & (var == "negative")
    shipped_det = QualitySettings().min_det_score
    by_family = {}
    for fam in a.positives:
        pos = found & np.isin(var, [f"{fam}{s}" for s in (3, 4, 5)])
        by_family[fam] = {
            "positives": f"{fam} at severity 3-5, found",
            "family": fam,
            "held_out": held_out(det[pos], fold[pos], det[clean], fold[clean]),
            "shipped": at_limit(det[pos], det[clean], shipped_det),
            "detector_score_threshold": float(Settings().detector.score_threshold),
        }
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
        for name in variants
    }
    rep = {
        "command": "python benchmarks/quality_strata.py " + " ".join(sys.argv[1:]),
        "photos": len(paths),
        "verify_gate": gate,
        "variants": other,
        "low_confidence": by_family[a.positives[0]],
        "low_confidence_by_family": by_family,
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
