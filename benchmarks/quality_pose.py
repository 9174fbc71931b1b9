"""The pose reason against a rendered head turn and LFW's real poses: does the landmark yaw follow a known turn,
where do the re-detected landmarks go, and what precision and recall does the yaw limit reach?

Each sampled pairs.txt photo is turned about a vertical axis by 15-75° (severity 1-5; the side from its path) with
a depth model: a cylinder of radius 1.3 inter-ocular distances through the face, plus a Gaussian nose
(``--nose-depth`` IOD high), z-buffered; the side of the head the turn brings into view is filled from beside the
head (``--side background``) or with the cheek's texture stretched (``--side cheek``). The turned photo is
re-detected (the CPU pipeline, the centre-most face). Recorded per turn: the yaw of the re-detected landmarks, of
the model's own landmarks turned (what a perfect detector would give), and how far each re-detected landmark lies
from where the model put it.

Every clean pairs.txt photo (``--clean-photos``, default all) goes through the CPU pipeline as served (largest
face, quality score, reasons): the negatives of the limit, the real-pose check and the clean-refusal guardrail at
the verify gate. The real-pose check compares two cues of the same face that a turn moves independently: the
nose's offset (the yaw estimate) and the eye distance's foreshortening against the eye-mouth height.

The pose limit is chosen on nine folds and measured on the tenth by the rule of
``facegate.eval.quality.reasons_study`` (at most 0.2 % of clean faces, the most lenient limit finding 85 % of
positives); positives: the turned faces at 45° or more, and, as a check, at 60° or more. ``yaw_before`` is the
estimate shipped before (a face size from the eye-mouth height once that exceeds the eye distance), ``yaw_fit`` a fit
of both cues (:func:`yaw_fit`), for comparison.

    python benchmarks/quality_pose.py --photos 600 --raw out/pose_raw.npz
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, pair_photo_sample
from facegate.config import QualitySettings, Settings
from facegate.errors import NoFaceError
from facegate.eval.degrade import path_rng
from facegate.eval.lfw import Pair, detect_centre, pair_images, read_pairs
from facegate.eval.quality import _fires, _pr, choose_limit
from facegate.io.decode import decode_image
from facegate.pipeline.pipeline import FacePipeline
from facegate.quality_reasons import EYE_MOUTH_PER_IOD, NOSE_DEPTH_IOD, NOSE_FRONTAL_T, landmark_geometry

log = logging.getLogger("quality_pose")
ANGLES = (15, 30, 45, 60, 75)


def depth(
    x: np.ndarray, y: np.ndarray, lm: np.ndarray, nose: float = 0.45
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Depth of the head model at source pixels ``x, y`` (same shape), whether each is on the head, ``xc``, ``r``."""
    iod = max(1.0, float(np.linalg.norm(lm[1] - lm[0])))
    xc, r = float(lm[[0, 1, 3, 4], 0].mean()), 1.3 * iod
    ey, my = lm[:2, 1].mean(), lm[3:, 1].mean()
    # full turn from the hair to the chin, fading out above and below (the neck and the shoulders stay)
    ramp = np.clip(np.minimum((y - (ey - 2.2 * iod)) / (0.7 * iod), (my + 1.4 * iod - y) / (0.7 * iod)), 0, 1)
    head = (np.abs(x - xc) < r) & (ramp > 0)
    z = np.where(head, np.sqrt(np.clip(r * r - (x - xc) ** 2, 0, None)), 0.0)
    z = z + nose * iod * np.exp(-((x - lm[2, 0]) ** 2 + (y - lm[2, 1]) ** 2) / (2 * (0.3 * iod) ** 2))
    return z, ramp * head, xc, r


def head_turn(img: np.ndarray, deg: float, lm: np.ndarray, nose: float = 0.45, side: str = "background") -> np.ndarray:
    """``(H, W, 3) uint8`` photo with the head of landmarks ``lm (5, 2)`` turned by ``deg`` degrees."""
    h, w = img.shape[:2]
    x, y = np.meshgrid(np.arange(4 * w) / 4, np.arange(h, dtype=np.float64))  # 4 samples per output pixel
    z, ramp, xc, r = depth(x, y, lm, nose)
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
    if side == "cheek" and deg != 0:
        # the band between the head's outline and the photo's turned edge: the cheek (0.6-0.85 r from the axis)
        # stretched over it, so that the head keeps its width instead of showing the background
        sgn = 1.0 if deg > 0 else -1.0
        rr = ramp[:, ::4].max(axis=1)
        edge, b = xc - sgn * r, xc - sgn * r * np.cos(np.radians(abs(deg)) * rr)[:, None]
        band = (rr[:, None] > 0) & ((cols - b) * sgn < 0) & (np.abs(cols - xc) < r) & (src < 0)
        frac = np.clip((cols - edge) / np.where(np.abs(b - edge) > 1e-6, b - edge, 1.0), 0, 1)
        src = np.where(band, xc - sgn * r * (0.6 + 0.25 * (1 - frac)), src)
    src = np.where(src >= 0, src, np.clip(np.where(cols < xc, xc - r - 1, xc + r + 1), 0, w - 1))
    ys = np.broadcast_to(np.arange(h, dtype=np.float32)[:, None], (h, w))
    return cv2.remap(img, src.astype(np.float32), np.ascontiguousarray(ys), cv2.INTER_LINEAR)


def turned_landmarks(lm: np.ndarray, deg: float, nose: float = 0.45) -> np.ndarray:
    """``(5, 2)``: the model's own landmarks turned by ``deg``: where a perfect detector would put them."""
    z, _, xc, _ = depth(lm[:, 0], lm[:, 1], lm, nose)
    th = np.radians(deg)
    out = lm.copy()
    out[:, 0] = xc + (lm[:, 0] - xc) * np.cos(th) + z * np.sin(th)
    return out


def yaw_before(lm: np.ndarray) -> float:
    """The yaw estimate shipped before: the nose offset over ``max(eye distance, eye-mouth height / 1.153)``."""
    eyes, mouth = (lm[0] + lm[1]) / 2, (lm[3] + lm[4]) / 2
    iod, axis = float(np.linalg.norm(lm[1] - lm[0])), mouth - eyes
    height = float(np.linalg.norm(axis))
    if iod < 1e-6 or height < 1e-6:
        return 0.0
    u, rel = axis / height, lm[2] - eyes
    across = float(u[0] * rel[1] - u[1] * rel[0])
    return math.degrees(math.atan2(-across / max(iod, height / EYE_MOUTH_PER_IOD), NOSE_DEPTH_IOD))


_FIT_GRID = np.radians(np.arange(0.0, 90.25, 0.25))


def yaw_fit(lm: np.ndarray, frontal: float) -> float:
    """Yaw of ``(5, 2)`` landmarks from both cues a turn moves, fitted to a rigid mean face: over the eye-mouth
    height (which a turn leaves alone) the nose's offset reads ``NOSE_DEPTH_IOD · frontal · sin(yaw)`` and the eye
    distance ``frontal · cos(yaw)``; least squares over yaw on a 0.25° grid, the sign from the nose. ``frontal``:
    a frontal face's eye distance over eye-mouth height."""
    eyes, mouth = (lm[0] + lm[1]) / 2, (lm[3] + lm[4]) / 2
    axis = mouth - eyes
    h = float(np.linalg.norm(axis))
    if h < 1e-6:
        return 0.0
    u, rel = axis / h, lm[2] - eyes
    across = -float(u[0] * rel[1] - u[1] * rel[0]) / h
    f = float(np.linalg.norm(lm[1] - lm[0])) / h
    err = (abs(across) - NOSE_DEPTH_IOD * frontal * np.sin(_FIT_GRID)) ** 2 + (f - frontal * np.cos(_FIT_GRID)) ** 2
    return math.copysign(math.degrees(float(_FIT_GRID[int(np.argmin(err))])), across)


def foreshortening(lm: np.ndarray) -> float:
    """Eye distance over eye-mouth height of ``(5, 2)`` landmarks: falls as ``cos(yaw)``, independent of the nose."""
    h = float(np.linalg.norm((lm[3] + lm[4] - lm[0] - lm[1]) / 2))
    return float(np.linalg.norm(lm[1] - lm[0])) / max(h, 1e-6)


def collect(a: argparse.Namespace) -> dict[str, np.ndarray]:
    """Detect, turn and re-detect the sample; run every clean photo through the pipeline as served."""
    folds, paths = pair_photo_sample(a.lfw, a.photos)
    pipe = FacePipeline.from_settings(Settings(device="cpu", precision="fp32"))
    gate = float(pipe.operating.quality_threshold)
    nan5 = np.full((5, 2), np.nan)
    turn: dict[str, list[Any]] = {k: [] for k in ("path", "sev", "side", "lm0", "ideal", "det")}
    t0 = time.perf_counter()
    for q in paths:
        img = decode_image((a.lfw / "lfw-deepfunneled" / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
        d = detect_centre(pipe, [img])[0]
        if d is None:
            continue
        lm = np.asarray(d.landmarks, np.float64)
        side = 1 if path_rng(q, 30).random() < 0.5 else -1
        for s, deg in enumerate(ANGLES, 1):
            dd = detect_centre(pipe, [head_turn(img, side * deg, lm, a.nose_depth, a.side)])[0]
            got = nan5 if dd is None else np.asarray(dd.landmarks, np.float64)
            row = (q, s, side, lm, turned_landmarks(lm, side * deg, a.nose_depth), got)
            for k, v in zip(turn, row, strict=True):
                turn[k].append(v)
    t_turn = time.perf_counter() - t0
    every = sorted(pair_images(read_pairs(a.lfw)))
    every = every[:: max(1, len(every) // a.clean_photos)][: a.clean_photos] if a.clean_photos else []
    clean: dict[str, list[Any]] = {k: [] for k in ("path", "found", "lm", "score", "other_refusal", "emb")}
    for n, q in enumerate(every, 1):
        img = decode_image((a.lfw / "lfw-deepfunneled" / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
        try:
            face = pipe.faces([img])[0][0]
        except NoFaceError:
            face = None
        clean["path"].append(q)
        clean["found"].append(face is not None)
        clean["lm"].append(nan5 if face is None else np.asarray(face.detection.landmarks, np.float64))
        clean["score"].append(np.nan if face is None else face.quality.score)
        clean["emb"].append(np.full(128, np.nan, np.float32) if face is None else face.embedding)
        # refused for anything but pose (the pose reason is recomputed below, under each estimate)
        other = face is not None and (face.quality.score < gate or any(r.code != "pose" for r in face.quality.reasons))
        clean["other_refusal"].append(other)
        if n % 1000 == 0:
            log.info("%d/%d clean photos, %.0f s", n, len(every), time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    out = {k: np.asarray(v) for k, v in turn.items()} | {f"clean_{k}": np.asarray(v) for k, v in clean.items()}
    out["fold_of_path"] = np.asarray([folds[p.split("/")[0]] for p in out["path"]])
    out["clean_fold"] = np.asarray([folds[p.split("/")[0]] for p in out["clean_path"]], np.int64)
    match = float(pipe.operating.match_threshold)
    out["meta"] = np.asarray([gate, t_turn, seconds, a.photos, a.clean_photos, a.nose_depth, match], np.float64)
    return out


def held_out(pos: np.ndarray, pos_fold: np.ndarray, neg: np.ndarray, neg_fold: np.ndarray) -> dict[str, Any]:
    """Precision and recall of a yaw limit (fires above it) chosen on nine folds, pooled over the tenths."""
    limits, pos_fired, neg_fired = [], [], []
    for f in range(10):
        lim = choose_limit(pos[pos_fold != f], neg[neg_fold != f], +1, max_clean=0.002, min_recall=0.85)
        limits.append(round(lim, 2))
        pos_fired.append(_fires(pos[pos_fold == f], lim, 1))
        neg_fired.append(_fires(neg[neg_fold == f], lim, 1))
    return {**_pr(np.concatenate(pos_fired), np.concatenate(neg_fired)), "fold_limits": limits}


def med(v: np.ndarray) -> float | None:
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else None


def analyse(r: dict[str, np.ndarray], frontal: float, pairs: list[Pair]) -> dict[str, Any]:
    """Per-turn tables, the real-pose check and stratum, held-out precision and recall, the clean-refusal guardrail;
    ``frontal``: a frontal face's eye distance over eye-mouth height (:func:`fore_yaw`); ``pairs``: pairs.txt's."""
    est = {
        "yaw": lambda lm: landmark_geometry(lm)[1],
        "yaw_before": yaw_before,
        "yaw_fit": lambda lm: yaw_fit(lm, frontal),
    }
    found = np.isfinite(r["det"][:, 0, 0])
    iod0 = np.linalg.norm(r["lm0"][:, 1] - r["lm0"][:, 0], axis=1)
    lag = r["side"][:, None] * (r["det"][:, :, 0] - r["ideal"][:, :, 0]) / iod0[:, None]  # toward the turn, IOD
    yaws = {
        k: {w: np.array([f(x) if np.isfinite(x).all() else np.nan for x in r[w]]) for w in ("lm0", "ideal", "det")}
        for k, f in est.items()
    }
    per_angle = {}
    for s, deg in enumerate(ANGLES, 1):
        m, mf = r["sev"] == s, (r["sev"] == s) & found
        row: dict[str, Any] = {"faces": int(m.sum()), "found": float(found[m].mean())}
        for k, y in yaws.items():
            change = r["side"][mf] * (y["det"][mf] - y["lm0"][mf])
            row[k] = {
                "detected_change_median": med(change),
                "detected_change_iqr": [float(v) for v in np.quantile(change, [0.25, 0.75])],
                "ideal_change_median": med(r["side"][m] * (y["ideal"][m] - y["lm0"][m])),
            }
        row["lag_iod"] = {  # re-detected minus the model's landmark, along the turn, in inter-ocular distances
            "eyes": med(lag[mf][:, :2].mean(axis=1)),
            "nose": med(lag[mf][:, 2]),
            "mouth": med(lag[mf][:, 3:].mean(axis=1)),
        }
        row["foreshortening_yaw_median"] = med(fore_yaw(r["det"][mf], frontal))
        per_angle[str(deg)] = row
    out: dict[str, Any] = {"per_angle": per_angle}
    cf = r["clean_found"].astype(bool)
    if not cf.any():
        return out
    clm = r["clean_lm"][cf]
    clean_yaw = {k: np.abs(np.array([f(x) for x in clm])) for k, f in est.items()}
    pitch = np.abs(np.array([landmark_geometry(x)[2] for x in clm]))
    fy = fore_yaw(clm, frontal)
    bins = ((0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 90))
    out["real_check"] = [
        {
            "yaw": f"{lo}-{hi}",
            "faces": int(((clean_yaw["yaw"] >= lo) & (clean_yaw["yaw"] < hi)).sum()),
            "foreshortening_yaw_median": med(fy[(clean_yaw["yaw"] >= lo) & (clean_yaw["yaw"] < hi)]),
        }
        for lo, hi in bins
    ]
    neg_f = r["clean_fold"][cf]
    qs = QualitySettings()
    out["held_out"] = {}
    for k in est:
        det_abs = np.abs(yaws[k]["det"])
        pos = {lo: found & (r["sev"] >= s) for lo, s in ((45, 3), (60, 4))}
        out["held_out"][k] = {
            f"turn_ge_{lo}": held_out(det_abs[m], r["fold_of_path"][m], clean_yaw[k], neg_f) for lo, m in pos.items()
        }
        out["held_out"][k]["clean_abs_yaw_quantiles"] = {
            str(p): float(np.quantile(clean_yaw[k], p)) for p in (0.5, 0.9, 0.99, 0.998, 1.0)
        }
    other = r["clean_other_refusal"][cf].astype(bool)
    refusal = {}
    for k in est:
        pose = (clean_yaw[k] > qs.max_yaw_deg) | (pitch > qs.max_pitch_deg)
        refusal[k] = {
            "pose_fires": float(pose.mean()),
            "refused": float((other | pose).mean()),
            "refused_faces": int((other | pose).sum()),
        }
    # a face fails when one of its pairs.txt genuine comparisons (clean against clean) misses the match threshold
    row = {p: i for i, p in enumerate(r["clean_path"][cf])}
    emb = r["clean_emb"][cf].astype(np.float32)
    fails = np.zeros(cf.sum(), bool)
    compared = np.zeros(cf.sum(), bool)
    for p in pairs:
        if p.same and p.a in row and p.b in row:
            i, j = row[p.a], row[p.b]
            miss = float(emb[i] @ emb[j]) < float(r["meta"][6])
            fails[[i, j]] |= miss
            compared[[i, j]] = True
    out["real_stratum"] = [
        {
            "yaw": f"{lo}-{hi}",
            "faces": int((m := compared & (clean_yaw["yaw"] >= lo) & (clean_yaw["yaw"] < hi)).sum()),
            "failing": float(fails[m].mean()) if m.any() else None,
            "pose_fires": float((clean_yaw["yaw"][m] > qs.max_yaw_deg).mean()) if m.any() else None,
        }
        for lo, hi in ((0, 20), (20, 30), (30, 40), (40, 50), (50, 90))
    ]
    fired = compared & (clean_yaw["yaw"] > qs.max_yaw_deg)
    out["real_stratum_fired"] = {
        "faces": int(fired.sum()),
        "failing": float(fails[fired].mean()) if fired.any() else None,
        "failing_overall": float(fails[compared].mean()),
        "compared_faces": int(compared.sum()),
        "match_threshold": float(r["meta"][6]),
    }
    # pitch is not tested here; what the clean faces say about its frontal reference
    eyes, mouth = (clm[:, 0] + clm[:, 1]) / 2, (clm[:, 3] + clm[:, 4]) / 2
    axis = mouth - eyes
    height = np.linalg.norm(axis, axis=1)
    along = np.einsum("ij,ij->i", clm[:, 2] - eyes, axis / height[:, None]) / height
    out["pitch"] = {
        "frontal_nose_place_median": float(np.median(along[clean_yaw["yaw"] < 10])),
        "template_nose_place": NOSE_FRONTAL_T,
        "clean_abs_pitch_quantiles": {str(p): float(np.quantile(pitch, p)) for p in (0.5, 0.9, 0.99, 0.998, 1.0)},
    }
    out["clean_refusal"] = {
        "verify_gate": float(r["meta"][0]),
        "max_yaw_deg": qs.max_yaw_deg,
        "max_pitch_deg": qs.max_pitch_deg,
        "clean_faces": int(cf.sum()),
        "not_found": int((~cf).sum()),
        "other_reasons_or_gate": float(other.mean()),
        **refusal,
    }
    return out


def fore_yaw(lms: np.ndarray, frontal: float) -> np.ndarray:
    """``(K,)`` yaw in degrees of ``(K, 5, 2)`` landmarks from the eye distance's foreshortening alone,
    ``acos(ratio / frontal)``, with ``frontal`` the ratio of a frontal face."""
    f = np.array([foreshortening(x) if np.isfinite(x).all() else np.nan for x in lms])
    return np.degrees(np.arccos(np.clip(f / frontal, 0, 1)))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lfw", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "/work/shared/data/lfw")))
    ap.add_argument("--photos", type=int, default=600, help="photos to turn")
    ap.add_argument("--clean-photos", type=int, default=7701, help="clean photos (0: none, no limit measured)")
    ap.add_argument("--nose-depth", type=float, default=0.45, help="the Gaussian nose's height, in IOD")
    ap.add_argument("--side", choices=("background", "cheek"), default="background")
    ap.add_argument("--raw", type=Path, help="where the detections are kept (.npz); read back if it exists")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_pose-cpu2.json"))
    a = ap.parse_args()
    if a.raw is not None and a.raw.is_file():
        r = dict(np.load(a.raw))
    else:
        r = collect(a)
        if a.raw is not None:
            a.raw.parent.mkdir(parents=True, exist_ok=True)
            np.savez(a.raw, **r)
    t_turn, seconds = (float(v) for v in r["meta"][1:3])
    cf = r["clean_found"].astype(bool)
    # a frontal face's eye distance over eye-mouth height for this detector: LFW's clean faces under 10° of yaw
    # (else the sample's own clean faces)
    lm = r["clean_lm"][cf] if cf.any() else r["lm0"]
    y = np.abs(np.array([landmark_geometry(x)[1] for x in lm]))
    frontal = float(np.median([foreshortening(x) for x in lm[y < 10]]))
    rep = {
        "command": "python benchmarks/quality_pose.py " + " ".join(sys.argv[1:]),
        "photos": int(r["meta"][3]),
        "clean_photos": int(r["clean_path"].size),
        "angles_deg": list(ANGLES),
        "nose_depth_iod": float(r["meta"][5]),
        "side": a.side,
        "foreshortening_frontal": frontal,
        **analyse(r, frontal, read_pairs(a.lfw)),
        "env": env_record(photos=int(r["meta"][3]), seconds=round(seconds, 1), turn_seconds=round(t_turn, 1)),
    }
    a.out.write_text(json.dumps(rep, indent=1))
    for deg, v in rep["per_angle"].items():
        log.info("%s°: yaw %s, before %s, lag %s", deg, v["yaw"], v["yaw_before"], v["lag_iod"])
    for k, v in rep.get("held_out", {}).items():
        log.info("held out %s: %s", k, {s: {m: x for m, x in d.items() if m != "fold_limits"} for s, d in v.items()})
    log.info("clean refusal: %s", rep.get("clean_refusal"))


if __name__ == "__main__":
    main()
