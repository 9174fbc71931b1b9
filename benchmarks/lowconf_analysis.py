"""The analysis of ``quality_lowconf.py``'s per-face rows: each candidate signal's held-out precision and recall per
labelled stratum, two signals together, the shipped rule as served, the real stratum and the clean-refusal
guardrail at the verify gate."""

from __future__ import annotations

from typing import Any

import numpy as np

from facegate.config import QualitySettings
from facegate.eval.lfw import Pair
from facegate.quality_reasons import (
    face_outside_box,
    face_outside_photo,
    face_reasons,
    landmark_geometry,
    similarity_fit,
)
from facegate.types import Detection
from quality_eval import choose_limit, past_limit, precision_recall

#: the clean budget of a limit (share of clean faces it may fire on), and the recall the rule aims past
MAX_CLEAN = 0.002
MIN_RECALL = 0.85
#: signal → direction (+1: fires above the limit, -1: below)
DIRECTION = {
    "det_score": -1,
    "cls": -1,
    "obj": -1,
    "lm_residual": +1,
    "out_of_box": +1,
    "out_of_photo": +1,
    "box_out_of_photo": +1,
}
PAIRS = (
    ("det_score", "lm_residual"),
    ("det_score", "out_of_box"),
    ("det_score", "out_of_photo"),
    ("cls", "out_of_photo"),
    ("obj", "out_of_photo"),
)


def detection(r: dict[str, np.ndarray], i: int) -> Detection:
    """Row ``i``'s face as the pipeline served it."""
    h, w = (int(v) for v in r["hw"][i])
    lm = r["lm"][i].astype(np.float32)
    return Detection(box=r["box"][i].astype(np.float32), landmarks=lm, score=float(r["score"][i]), photo_wh=(w, h))


def box_out_of_photo(box: np.ndarray, hw: np.ndarray) -> np.ndarray:
    """``(N,)`` share of each unclipped box ``(N, 4)`` (x0, y0, x1, y1) outside its photo ``hw (N, 2)``."""
    w, h = box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]
    iw = np.clip(np.minimum(box[:, 2], hw[:, 1]) - np.maximum(box[:, 0], 0), 0, None)
    ih = np.clip(np.minimum(box[:, 3], hw[:, 0]) - np.maximum(box[:, 1], 0), 0, None)
    return 1.0 - iw * ih / np.maximum(w * h, 1e-9)


def landmark_residual(landmarks: np.ndarray) -> float:
    """Root-mean-square distance, in 112×112 crop pixels, of the ``(5, 2)`` landmarks (source pixels) from the ArcFace
    template after alignment's similarity fit: how far the five points are from a face's shape (0 for any rotated,
    scaled, shifted template)."""
    _, _, res = similarity_fit(landmarks)
    return float(np.sqrt(np.mean(np.abs(res) ** 2)))


def signals(r: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every candidate signal per row (NaN where no face was found)."""
    f = r["found"].astype(bool)
    out = {k: np.full(f.size, np.nan) for k in DIRECTION}
    out["det_score"][f], out["cls"][f], out["obj"][f] = r["score"][f], r["cls"][f], r["obj"][f]
    out["lm_residual"][f] = [landmark_residual(m) for m in r["lm"][f]]
    out["out_of_box"][f] = [face_outside_box(m, b) for m, b in zip(r["lm"][f], r["box"][f], strict=True)]
    out["out_of_photo"][f] = [face_outside_photo(detection(r, i)) for i in np.flatnonzero(f)]
    out["box_out_of_photo"][f] = box_out_of_photo(r["rawbox"][f], r["hw"][f])
    return out


def held_out(
    sig: dict[str, np.ndarray], names: tuple[str, ...], pos: np.ndarray, neg: np.ndarray, fold: np.ndarray
) -> dict[str, Any]:
    """Precision and recall on each fold of the rule "any of ``names`` fires", its limits chosen on the other nine:
    each by the reasons' rule (at most :data:`MAX_CLEAN` of clean faces, the most lenient limit finding
    :data:`MIN_RECALL` of positives, else the best recall) within an equal share of that budget."""
    budget, want = MAX_CLEAN / len(names), MIN_RECALL
    pos_fired, neg_fired, limits = [], [], []
    for f in range(10):
        tr_p, tr_n, te_p, te_n = pos & (fold != f), neg & (fold != f), pos & (fold == f), neg & (fold == f)
        fp, fn, lims = np.zeros(te_p.sum(), bool), np.zeros(te_n.sum(), bool), []
        for k in names:
            d = DIRECTION[k]
            lim = choose_limit(sig[k][tr_p], sig[k][tr_n], d, max_clean=budget, min_recall=want)
            lims.append(round(lim, 4))
            fp |= past_limit(sig[k][te_p], lim, d)
            fn |= past_limit(sig[k][te_n], lim, d)
        pos_fired.append(fp)
        neg_fired.append(fn)
        limits.append(lims)
    all_lims = [choose_limit(sig[k][pos], sig[k][neg], DIRECTION[k], max_clean=budget, min_recall=want) for k in names]
    return {
        "signals": list(names),
        **precision_recall(np.concatenate(pos_fired), np.concatenate(neg_fired)),
        "fold_limits": limits,
        "limits_all_folds": all_lims,
    }


def shipped_fires(r: dict[str, np.ndarray], limits: QualitySettings) -> np.ndarray:
    """``(N,)`` whether ``face_reasons`` at ``limits`` gives the row's face ``low_confidence`` (False: not found)."""
    out = np.zeros(r["found"].size, bool)
    for i in np.flatnonzero(r["found"].astype(bool)):
        out[i] = any(x.code == "low_confidence" for x in face_reasons(detection(r, i), None, 1.0, 0.0, limits))
    return out


def quantiles(v: np.ndarray) -> dict[str, float]:
    return {str(p): float(np.quantile(v, p)) for p in (0.0, 0.002, 0.01, 0.5, 0.99, 0.998, 1.0)}


def analyse(r: dict[str, np.ndarray], pairs: list[Pair], families: tuple[str, ...]) -> dict[str, Any]:
    """The report's body (see the module docstring)."""
    sig = signals(r)
    var, found, fold = r["variant"], r["found"].astype(bool), r["fold"]
    clean = found & (var == "clean")
    pos_of = {fam: found & np.isin(var, [f"{fam}{s}" for s in (3, 4, 5)]) for fam in families}
    pos_of["any"] = np.logical_or.reduce([pos_of[fam] for fam in families])
    gate, match = float(r["meta"][0]), float(r["meta"][1])
    qs = QualitySettings()
    fires = shipped_fires(r, qs)
    rep: dict[str, Any] = {
        "verify_gate": gate,
        "shipped_settings": {k: getattr(qs, k) for k in ("min_det_score", "max_outside_photo")},
        "collected": {"command": str(r["collected"][0]), "git_commit": str(r["collected"][1])},
    }
    rep["variants"] = {
        name: {
            "faces": int((var == name).sum()),
            "found": float(found[var == name].mean()),
            **{f"{k}_median": float(np.nanmedian(v[found & (var == name)])) for k, v in sig.items()},
            "shipped_fires": float(fires[found & (var == name)].mean()),
        }
        for name in dict.fromkeys(var.tolist())
    }
    rep["clean_quantiles"] = {k: quantiles(v[clean]) for k, v in sig.items()}
    # the face region past the clipped box against the head's turn (LFW's clean faces, the landmark yaw)
    yaw = np.abs([landmark_geometry(m)[1] for m in r["lm"][clean]])
    ob = sig["out_of_box"][clean]
    rep["clean_out_of_box_by_yaw"] = [
        {"yaw": f"{lo}-{hi}", "faces": int(m.sum()), "median": float(np.median(ob[m])) if m.any() else None}
        for lo, hi in ((0, 10), (10, 20), (20, 30), (30, 45), (45, 90))
        for m in [(yaw >= lo) & (yaw < hi)]
    ]
    rep["single"] = {fam: {k: held_out(sig, (k,), pos, clean, fold) for k in DIRECTION} for fam, pos in pos_of.items()}
    rep["pairs"] = {
        fam: {"+".join(p): held_out(sig, p, pos, clean, fold) for p in PAIRS} for fam, pos in pos_of.items()
    }
    rep["shipped"] = {fam: precision_recall(fires[pos], fires[clean]) for fam, pos in pos_of.items()}
    # the real stratum: a clean face fails when one of its pairs.txt genuine comparisons misses the match threshold
    rows = np.flatnonzero(clean)
    row = {p: i for i, p in zip(rows, r["path"][rows], strict=True)}
    fails, compared = np.zeros(found.size, bool), np.zeros(found.size, bool)
    for p in pairs:
        if p.same and p.a in row and p.b in row:
            i, j = row[p.a], row[p.b]
            miss = float(r["emb"][i].astype(np.float32) @ r["emb"][j].astype(np.float32)) < match
            fails[[i, j]] |= miss
            compared[[i, j]] = True
    fired = compared & fires
    rep["real_stratum"] = {
        "compared_faces": int(compared.sum()),
        "fires": int(fired.sum()),
        "failing_among_fired": float(fails[fired].mean()) if fired.any() else None,
        "failing_overall": float(fails[compared].mean()),
        "match_threshold": match,
    }
    other = r["other"].astype(bool) | (r["quality"] < gate)
    all_clean = var == "clean"
    rep["clean_refusal"] = {
        "clean_faces": int(clean.sum()),
        "not_found": int((all_clean & ~found).sum()),
        "low_confidence_fires": float(fires[clean].mean()),
        "other_reasons_or_gate": float(other[clean].mean()),
        "refused": float((other | fires)[clean].mean()),
        "refused_faces": int((other | fires)[clean].sum()),
    }
    return rep
