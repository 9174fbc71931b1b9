"""The pose reason against a rendered head turn: does the re-detected landmark yaw follow the nominal turn, and
what precision and recall does the yaw limit reach?

Each sampled pairs.txt photo is turned about a vertical axis by 15-75° (severity 1-5; the side from its path) with
a depth model: a cylinder of radius 1.3 inter-ocular distances through the face, plus a 0.45-IOD nose, z-buffered,
the uncovered background filled from beside the head. The turned photo is re-detected (the CPU pipeline, the
centre-most face) and its landmark yaw measured. Negatives for the limit are the clean faces of the P1 features;
positives the turned faces at severity ≥ 3 (≥ 45°); limits are chosen on nine folds and measured on the tenth, by
the rule of ``facegate.eval.quality.reasons_study``.

    python benchmarks/quality_pose.py --features out/p1_half1_r.npz out/p1_half2_r.npz --photos 600
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, pair_photo_sample
from facegate.config import Settings
from facegate.eval.degrade import path_rng
from facegate.eval.lfw import detect_centre
from facegate.eval.quality import _fires, choose_limit, load_table
from facegate.io.decode import decode_image
from facegate.pipeline.pipeline import FacePipeline
from facegate.quality_reasons import landmark_geometry

log = logging.getLogger("quality_pose")
ANGLES = (15, 30, 45, 60, 75)


def depth(x: np.ndarray, y: np.ndarray, lm: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Depth of the head model at source pixels ``x, y`` (same shape), whether each is on the head, ``xc``, ``r``."""
    iod = max(1.0, float(np.linalg.norm(lm[1] - lm[0])))
    xc, r = float(lm[[0, 1, 3, 4], 0].mean()), 1.3 * iod
    ey, my = lm[:2, 1].mean(), lm[3:, 1].mean()
    # full turn from the hair to the chin, fading out above and below (the neck and the shoulders stay)
    ramp = np.clip(np.minimum((y - (ey - 2.2 * iod)) / (0.7 * iod), (my + 1.4 * iod - y) / (0.7 * iod)), 0, 1)
    head = (np.abs(x - xc) < r) & (ramp > 0)
    z = np.where(head, np.sqrt(np.clip(r * r - (x - xc) ** 2, 0, None)), 0.0)
    z = z + 0.45 * iod * np.exp(-((x - lm[2, 0]) ** 2 + (y - lm[2, 1]) ** 2) / (2 * (0.3 * iod) ** 2))
    return z, ramp * head, xc, r


def head_turn(img: np.ndarray, deg: float, lm: np.ndarray) -> np.ndarray:
    """``(H, W, 3) uint8`` photo with the head of landmarks ``lm (5, 2)`` turned by ``deg`` degrees."""
    h, w = img.shape[:2]
    x, y = np.meshgrid(np.arange(4 * w) / 4, np.arange(h, dtype=np.float64))  # 4 samples per output pixel
    z, ramp, xc, r = depth(x, y, lm)
    th = np.radians(deg) * ramp
    xo = np.where(ramp > 0, xc + (x - xc) * np.cos(th) + z * np.sin(th), x)
    zo = np.where(ramp > 0, -(x - xc) * np.sin(th) + z * np.cos(th), -1e9)
    key = (y.astype(np.int64) * w + np.clip(np.round(xo).astype(np.int64), 0, w - 1)).ravel()
    best = np.full(h * w, -np.inf)
    np.maximum.at(best, key, zo.ravel())
    win = zo.ravel() >= best[key]  # the nearest surface point wins each output pixel
    src = np.full(h * w, -1.0)
    src[key[win]] = x.ravel()[win]
    cols = np.broadcast_to(np.arange(w, dtype=np.float64), (h, w))
    src = src.reshape(h, w)
    src = np.where(src >= 0, src, np.clip(np.where(cols < xc, xc - r - 1, xc + r + 1), 0, w - 1))
    ys = np.broadcast_to(np.arange(h, dtype=np.float32)[:, None], (h, w))
    return cv2.remap(img, src.astype(np.float32), np.ascontiguousarray(ys), cv2.INTER_LINEAR)


def projected_yaw(lm: np.ndarray, deg: float) -> float:
    """Landmark yaw of the model's own landmarks turned by ``deg``: what a perfect detector would report."""
    z, _, xc, _ = depth(lm[:, 0], lm[:, 1], lm)
    th = np.radians(deg)
    out = lm.copy()
    out[:, 0] = xc + (lm[:, 0] - xc) * np.cos(th) + z * np.sin(th)
    return landmark_geometry(out)[1]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", nargs="+", required=True)
    ap.add_argument("--lfw", type=Path, default=Path("/work/shared/data/lfw"))
    ap.add_argument("--photos", type=int, default=600)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_pose-cpu2.json"))
    a = ap.parse_args()
    folds, paths = pair_photo_sample(a.lfw, a.photos)
    pipe = FacePipeline.from_settings(Settings(device="cpu", precision="fp32"))
    rows = []
    t0 = time.perf_counter()
    for q in paths:
        img = decode_image((a.lfw / "lfw-deepfunneled" / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
        d = detect_centre(pipe, [img])[0]
        if d is None:
            continue
        lm = np.asarray(d.landmarks, np.float64)
        y0 = landmark_geometry(lm)[1]
        side = 1 if path_rng(q, 30).random() < 0.5 else -1
        for s, deg in enumerate(ANGLES, 1):
            dd = detect_centre(pipe, [head_turn(img, side * deg, lm)])[0]
            yaw = np.nan if dd is None else landmark_geometry(dd.landmarks)[1]
            ideal = projected_yaw(lm, side * deg)
            rows.append((q, s, y0, yaw, ideal, side))
    seconds = time.perf_counter() - t0
    q, sev, y0, yaw, ideal, side = (np.asarray(v) for v in zip(*rows, strict=True))
    found = np.isfinite(yaw)
    per_angle = {}
    for s, deg in enumerate(ANGLES, 1):
        m = sev == s
        change = side[m & found] * (yaw[m & found] - y0[m & found])
        per_angle[str(deg)] = {
            "faces": int(m.sum()),
            "found": float(found[m].mean()),
            "measured_change_median": float(np.median(change)),
            "measured_change_iqr": [float(v) for v in np.quantile(change, [0.25, 0.75])],
            "measured_abs_yaw_median": float(np.median(np.abs(yaw[m & found]))),
            "projected_change_median": float(np.median(side[m] * (ideal[m] - y0[m]))),
        }
    t = load_table(a.features)
    clean = t["found"] & (t["variant"] == 0)
    neg_v, neg_f = t["abs_yaw"][clean], np.array([folds[i] for i in t["identity"][clean]])
    pos = found & (sev >= 3)
    pos_v, pos_f = np.abs(yaw[pos]), np.array([folds[p.split("/")[0]] for p in q[pos]])
    tp = fp = 0
    limits = []
    for f in range(10):
        lim = choose_limit(pos_v[pos_f != f], neg_v[neg_f != f], +1, max_clean=0.002, min_recall=0.85)
        limits.append(lim)
        tp += int(_fires(pos_v[pos_f == f], lim, 1).sum())
        fp += int(_fires(neg_v[neg_f == f], lim, 1).sum())
    rep = {
        "command": "python benchmarks/quality_pose.py " + " ".join(sys.argv[1:]),
        "photos": len(paths),
        "angles_deg": list(ANGLES),
        "per_angle": per_angle,
        "held_out": {
            "precision": tp / max(1, tp + fp),
            "recall": tp / max(1, pos_v.size),
            "clean_fire_rate": fp / max(1, neg_v.size),
            "positives": int(pos_v.size),
            "negatives": int(neg_v.size),
            "fold_limits": limits,
        },
        "clean_abs_yaw_quantiles": {str(p): float(np.quantile(neg_v, p)) for p in (0.5, 0.9, 0.99, 0.998, 1.0)},
        "env": env_record(photos=a.photos, seconds=seconds),
    }
    a.out.write_text(json.dumps(rep, indent=1))
    for deg, v in per_angle.items():
        own = v["projected_change_median"]
        print(f"{deg}°: measured {v['measured_change_median']:+.1f}° (the model's own landmarks {own:+.1f}°)")
    print("held out:", {k: v for k, v in rep["held_out"].items() if k != "fold_limits"})


if __name__ == "__main__":
    main()
