"""Protocol P1, the reasons' limits, the gates and the reliability, from one feature table.

The table (``benchmarks/quality_p1_features.py``) holds per LFW pairs.txt photo the clean face, a P1 degradation
and a reason degradation (``quality_p1_features.plan``). Comparisons: pairs.txt's, clean against clean and
clean (``a``, enrolled) against the other photo's P1 face (``b``, probe). Whatever is fitted scores each of the 10
identity-disjoint folds with a fit on the other nine.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from facegate.config import QualitySettings
from facegate.errors import InvalidParameterError
from facegate.eval.calibrate import calibrate
from facegate.eval.features import read_parts
from facegate.eval.lfw import Pair, read_pairs
from facegate.models.quality import fit_logistic_nd
from facegate.quality_reasons import RELIABILITY_FEATURES, ReliabilityModel, reliability_features
from quality_metrics import ci95, edc_curve, identity_weights, metrics, p1_report
from quality_p1_features import FACE_DEGRADATIONS, plan

#: per-face baselines: method → table column (higher is better)
BASELINES = {
    "feature_norm": "norm",
    "detector": "det",
    "heuristic": "heuristic",
    "rts_head": "rts",
    "serfiq": "serfiq",
    "flip_consistency": "flip_cos",
}
#: reason code → (its labelled degradations, the measured column, +1: fires above the limit, the Settings field)
REASONS = {
    "too_small": (("downscale",), "iod", -1, "min_iod_px"),
    "blur": (("blur",), "sharpness", -1, "min_sharpness"),
    "too_dark": (("underexpose",), "luma", -1, "min_luma"),
    "too_bright": (("overexpose",), "luma", +1, "max_luma"),
    "occluded": (("mask", "eyeband"), "flat", +1, "max_flat"),
    "pose": (("yaw",), "abs_yaw", +1, "max_yaw_deg"),
}
#: fusion inputs: column → the sign its weight must have (a monotone fusion: better never lowers the score)
FUSION = {"log_norm": +1, "log_iod": +1, "abs_yaw": -1, "flat": -1, "log_sharpness": +1}
#: the most of clean faces the verify gate (0.45 %: 0.5 % is the guardrail) and the enrolment gate may refuse
VERIFY_MAX_CLEAN, ENROL_MAX_CLEAN = 0.0045, 0.02


@dataclass
class PairSet:
    """Comparisons of a feature table: row indices ``a`` (enrolled side) and ``b`` (probe), all ``(P,)``."""

    a: np.ndarray
    b: np.ndarray
    same: np.ndarray
    fold: np.ndarray
    degraded: np.ndarray


def identity_folds(pairs: Sequence[Pair]) -> dict[str, int]:
    """Identity → fold of the pairs it appears in; raises if an identity appears in two folds."""
    out: dict[str, int] = {}
    for p in pairs:
        for img in (p.a, p.b):
            name = img.split("/")[0]
            if out.setdefault(name, p.fold) != p.fold:
                raise InvalidParameterError(f"identity {name} appears in folds {out[name]} and {p.fold}")
    return out


def load_table(parts: Sequence[str | Path]) -> dict[str, np.ndarray]:
    """:func:`~facegate.eval.features.read_parts` with ``variant`` (0 clean, 1 P1, 2 reason) and derived columns."""
    t = read_parts(parts)
    variant = np.zeros(t["path"].size, np.int8)
    i = 0
    while i < variant.size:  # rows come per photo: clean, then the variants its plan could make (face-drawn ones
        # need the clean photo's landmarks)
        made = [
            j for j, (d, _) in enumerate(plan(t["path"][i])) if j == 0 or t["found"][i] or d not in FACE_DEGRADATIONS
        ]
        variant[i : i + len(made)] = made
        i += len(made)
    t["variant"] = variant
    emb, flip = t["emb"].astype(np.float32), t["flip"].astype(np.float32)
    t["flip_cos"] = np.einsum("ij,ij->i", emb, flip)
    t["abs_yaw"], t["abs_pitch"] = np.abs(t["yaw"]), np.abs(t["pitch"])
    with np.errstate(divide="ignore", invalid="ignore"):
        t["log_norm"], t["log_iod"] = np.log(t["norm"]), np.log(t["iod"])
        t["log_sharpness"] = np.log1p(t["sharpness"])
    return t


def comparisons(t: dict[str, np.ndarray], pairs: Sequence[Pair], variant: int = 1) -> PairSet:
    """pairs.txt's pairs: clean vs clean, and clean ``a`` vs the other photo's ``variant`` face (both ways)."""
    row = {(p, int(v)): i for i, (p, v) in enumerate(zip(t["path"], t["variant"], strict=True))}
    sides = [(p, x, y, v) for p in pairs for x, y, v in ((p.a, p.b, 0), (p.a, p.b, variant), (p.b, p.a, variant))]
    cols = [(row[x, 0], row[y, v], p.same, p.fold, v > 0) for p, x, y, v in sides if (x, 0) in row and (y, v) in row]
    return PairSet(*(np.asarray(c) for c in zip(*cols, strict=True)))


def similarity(t: dict[str, np.ndarray], ps: PairSet) -> np.ndarray:
    """``(P,)`` cosine similarity, −1 where a face was not found."""
    emb = np.nan_to_num(t["emb"].astype(np.float32))
    ok = t["found"][ps.a] & t["found"][ps.b]
    return np.where(ok, np.einsum("ij,ij->i", emb[ps.a], emb[ps.b]), -1.0)


def fit_fusion(x: np.ndarray, y: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """Logistic regression of ``y`` on ``[1, x]`` whose weights keep their ``signs``: a wrong-signed input is
    dropped and the rest refitted. ``x``: ``(n, k)`` standardised; returns ``(k + 1,)`` weights."""
    use = np.ones(x.shape[1], bool)
    while True:
        w = np.zeros(x.shape[1] + 1)
        w[np.r_[True, use]] = fit_logistic_nd(np.column_stack([np.ones(len(x)), x[:, use]]), y)
        bad = use & (np.sign(w[1:]) != signs)
        if not bad.any():
            return w
        use &= ~bad


def fusion_scores(
    t: dict[str, np.ndarray], pairs: Sequence[Pair], ps: PairSet, sim: np.ndarray, threshold: float
) -> dict[str, Any]:
    """Cross-fitted monotone fusion of the norm and the reasons' measurements: ``{"score": (N,), ...}``, per face
    ``P(its genuine comparisons all succeed)``."""
    cols = list(FUSION)
    x = np.column_stack([t[c] for c in cols]).astype(np.float64)
    signs = np.array([FUSION[c] for c in cols])
    ok = t["found"] & np.isfinite(x).all(1)
    # each face's label: all its genuine comparisons (P1 and reason faces against the clean partner) succeed
    extra = comparisons(t, pairs, variant=2)
    g = np.concatenate([ps.b[ps.same], ps.a[ps.same & ~ps.degraded], extra.b[extra.same]])
    s = np.concatenate([sim[ps.same], sim[ps.same & ~ps.degraded], similarity(t, extra)[extra.same]])
    fail = np.zeros(x.shape[0], bool)
    seen = np.zeros(x.shape[0], bool)
    np.logical_or.at(fail, g, s < threshold)
    seen[g] = True
    fold = np.full(x.shape[0], -1)
    fold[np.concatenate([ps.a, ps.b])] = np.concatenate([ps.fold, ps.fold])
    fold[extra.b] = extra.fold
    score = np.full(x.shape[0], -np.inf)
    weights = []
    for f in sorted(set(ps.fold.tolist())):
        train = ok & seen & (fold != f) & (fold >= 0)
        mu, sd = x[train].mean(0), x[train].std(0) + 1e-9
        w = fit_fusion((x[train] - mu) / sd, (~fail[train]).astype(np.float64), signs)
        test = ok & (fold == f)
        score[test] = np.column_stack([np.ones(test.sum()), (x[test] - mu) / sd]) @ w
        weights.append([float(v) for v in w])
    return {"score": score, "inputs": cols, "fold_weights": weights}


def past_limit(v: np.ndarray, limit: float, direction: int) -> np.ndarray:
    """Where ``v`` is past ``limit``: above it (``direction`` +1) or below it (−1), as a reason fires."""
    return v > limit if direction > 0 else v < limit


def choose_limit(
    pos: np.ndarray, neg: np.ndarray, direction: int, *, max_clean: float = 0.002, min_recall: float = 0.85
) -> float:
    """The most lenient midpoint limit finding ``min_recall`` of ``pos`` while firing on at most ``max_clean`` of
    ``neg`` (else the best-recall one under ``max_clean``). The reasons' ``min_recall`` is above the 0.8 asked for,
    so that held-out folds keep 0.8."""
    vals = np.unique(np.concatenate([pos, neg]))
    cands = (vals[1:] + vals[:-1]) / 2
    neg_fire = np.array([past_limit(neg, c, direction).mean() for c in cands])
    rec = np.array([past_limit(pos, c, direction).mean() for c in cands])
    ok = neg_fire <= max_clean
    if not ok.any():
        return float(neg.min() - 1e-6 if direction < 0 else neg.max() + 1e-6)
    enough = ok & (rec >= min_recall)
    pick = np.flatnonzero(enough if enough.any() else ok)
    i = pick[np.argmin(rec[pick])] if enough.any() else pick[np.argmax(rec[pick])]
    return float(cands[i])


def precision_recall(pos_fired: np.ndarray, neg_fired: np.ndarray) -> dict[str, float]:
    """Precision, recall and clean fire rate of a reason firing on positives ``pos_fired`` and clean ``neg_fired``."""
    tp, fp = int(pos_fired.sum()), int(neg_fired.sum())
    return {
        "precision": tp / max(1, tp + fp),
        "recall": tp / max(1, pos_fired.size),
        "clean_fire_rate": fp / max(1, neg_fired.size),
        "positives": int(pos_fired.size),
        "negatives": int(neg_fired.size),
    }


def reasons_study(
    t: dict[str, np.ndarray],
    fold_of: np.ndarray,
    face_fail: np.ndarray,
    fixed: dict[str, float],
) -> dict[str, Any]:
    """Each reason's limit per held-out fold (:func:`choose_limit` on the other nine) and its precision and recall.

    Positives: the reason's degradations at severity ≥ 3; negatives: clean faces. ``fixed``: reason → a limit only
    measured. ``face_fail``: ``(N,)`` the face failed a genuine comparison (NaN: none), for the real stratum."""
    found = t["found"]
    clean = found & (t["variant"] == 0)
    deg, sev = t["degradation"], t["severity"]
    out: dict[str, Any] = {}
    shipped: dict[str, float] = {}
    for code, (degs, col, direction, field) in REASONS.items():
        v = np.nan_to_num(t[col].astype(np.float64), nan=0.0)
        if code == "occluded":  # as face_reasons: a badly exposed face is told about its exposure instead
            bad = (t["luma"] < shipped["too_dark"]) | (t["luma"] > shipped["too_bright"])
            v = np.where(bad, 0.0, v)
        pos = found & np.isin(deg, degs) & (sev >= 3)
        rows, held_pos, held_neg = [], [], []
        for f in range(10):
            tr, te = fold_of != f, fold_of == f
            lim = fixed.get(code) or choose_limit(v[pos & tr], v[clean & tr], direction)
            held_pos.append(past_limit(v[pos & te], lim, direction))
            held_neg.append(past_limit(v[clean & te], lim, direction))
            rows.append({"fold": f, "limit": lim, **precision_recall(held_pos[-1], held_neg[-1])})
        shipped[code] = fixed.get(code) or choose_limit(v[pos], v[clean], direction)
        real = clean & np.isfinite(face_fail)
        fire_real = past_limit(v[real], shipped[code], direction)
        by_sev = {
            f"{d}/{s}": float(past_limit(v[found & (deg == d) & (sev == s)], shipped[code], direction).mean())
            for d in degs
            for s in range(1, 6)
            if (found & (deg == d) & (sev == s)).any()
        }
        out[code] = {
            "column": col,
            "setting": field,
            "degradations": list(degs),
            "shipped_limit": shipped[code],
            "held_out": precision_recall(np.concatenate(held_pos), np.concatenate(held_neg)),
            "folds": rows,
            "fires_by_severity": by_sev,
            "real_stratum": {
                "clean_faces": int(real.sum()),
                "fires": int(fire_real.sum()),
                "failing_among_fired": float(face_fail[real][fire_real].mean()) if fire_real.any() else None,
                "failing_overall": float(face_fail[real].mean()),
            },
        }
    yaw, fail = t["abs_yaw"][clean], face_fail[clean]
    out["real_pose_bins"] = [
        {
            "yaw": f"{lo}-{hi}",
            "faces": int(m.sum()),
            "fail_rate": float(np.nanmean(fail[m])) if np.isfinite(fail[m]).any() else None,
            "pose_fires": float((yaw[m] > shipped["pose"]).mean()) if m.any() else None,
        }
        for lo, hi in itertools.pairwise([0, 10, 20, 30, 45, 90])
        for m in [(yaw >= lo) & (yaw < hi)]
    ]
    return out


def by_fold(fold_of: np.ndarray, rows: list[dict[str, Any]], key: str) -> np.ndarray:
    """``(N,)`` per face the ``key`` of its fold's row (0 where no row names its fold)."""
    out = np.zeros(fold_of.size)
    for row in rows:
        out[fold_of == row["fold"]] = row[key]
    return out


def refused(t: dict[str, np.ndarray], q: np.ndarray, gate: Any, limits: dict[str, Any]) -> np.ndarray:
    """``(N,)`` faces the verify path refuses: quality below ``gate`` or a reason past ``limits`` (reason → limit;
    each a number or ``(N,)`` per face; pitch and detector score at the shipped settings)."""
    fires = {code: past_limit(t[col], limits[code], direction) for code, (_, col, direction, _) in REASONS.items()}
    fires["occluded"] &= ~(fires["too_dark"] | fires["too_bright"])  # as face_reasons: exposure is named instead
    s = QualitySettings()
    return (
        (q < gate)
        | np.logical_or.reduce(list(fires.values()))
        | (t["abs_pitch"] > s.max_pitch_deg)
        | (t["det"] < s.min_det_score)
    )


def fold_means(fail: np.ndarray, pair_q: dict[str, np.ndarray], fold: np.ndarray) -> dict[str, Any]:
    """Per method the mean and standard deviation over folds of each metric."""
    per = {m: [metrics(fail[fold == f], q[fold == f]) for f in np.unique(fold)] for m, q in pair_q.items()}
    return {
        m: {k: {"mean": float(np.mean([r[k] for r in rs])), "std": float(np.std([r[k] for r in rs]))} for k in rs[0]}
        for m, rs in per.items()
    }


def eval_quality(
    features: Sequence[str | Path],
    root: Path,
    *,
    out: Path,
    match_threshold: float,
    plot: Path | None = None,
    command: str = "",
    draws: int = 1000,
    reliability_out: Path | None = None,
) -> dict[str, Any]:
    """Run everything on a feature table and write the JSON report to ``out`` (returned too)."""
    pairs = read_pairs(root)
    folds = identity_folds(pairs)
    t = load_table(features)
    fold_of = np.array([folds.get(i, -1) for i in t["identity"]])
    ps = comparisons(t, pairs)
    sim = similarity(t, ps)
    clean = t["variant"] == 0
    cal = calibrate(t["emb"][clean & t["found"]].astype(np.float32), t["identity"][clean & t["found"]])
    t4 = next(p["threshold"] for p in cal["points"] if p["fmr_target"] == 1e-4)
    fus = fusion_scores(t, pairs, ps, sim, match_threshold)
    scores = {m: np.nan_to_num(t[c].astype(np.float64), nan=-np.inf) for m, c in BASELINES.items()}
    scores["fusion"] = fus["score"]
    n = len(t["path"])
    kw = dict(a=ps.a, b=ps.b, found=t["found"], degradation=t["degradation"], identity=t["identity"], sim=sim)
    kw |= dict(face_scores=scores, threshold=match_threshold)
    p1 = p1_report(same=ps.same, severity=np.where(clean, 0, t["severity"]), threshold_check=t4, draws=draws, **kw)
    both = ps.same & t["found"][ps.a] & t["found"][ps.b]
    pair_q = {m: np.minimum(s[ps.a], s[ps.b])[both] for m, s in scores.items()}
    p1["fold_means"] = fold_means(sim[both] < match_threshold, pair_q, ps.fold[both])
    # the real-pose stratum: clean pairs where either face is turned 20° or more (LFW's own yaw, from landmarks)
    real = ps.same & ~ps.degraded & (np.maximum(t["abs_yaw"][ps.a], t["abs_yaw"][ps.b]) >= 20)
    p1["real_pose"] = None
    if real.sum() >= 20:
        p1["real_pose"] = p1_report(same=real, severity=np.zeros(n), draws=draws // 5, **kw)["all"]
    # a clean face's genuine outcome (NaN: no genuine comparison) for the reasons' real stratum
    face_fail = np.full(n, np.nan)
    g = ps.same & (sim > -1) & ~ps.degraded  # clean against clean: the real stratum has no synthetic partner
    for side in (ps.a, ps.b):
        np.fmax.at(face_fail, side[g], (sim[g] < match_threshold).astype(np.float64))
    # pose has no working label (the synthetic yaw warp hardly moves the landmark yaw): its limit stays the setting
    reasons = reasons_study(t, fold_of, face_fail, fixed={"pose": QualitySettings().max_yaw_deg})
    q = np.where(t["found"], np.nan_to_num(t["quality"]), 0.0)
    ok = t["found"] & clean
    held = {c: by_fold(fold_of, reasons[c]["folds"], "limit") for c in REASONS}
    shipped = {c: reasons[c]["shipped_limit"] for c in REASONS}
    by_reason = refused(t, q, 0.0, held)
    gates = gate_study(q, clean, t["identity"], fold_of, ps, sim, match_threshold, by_reason, draws=draws)
    gates["clean_faces_refused_with_reasons"] = {
        "held_out_verify_gate": float(refused(t, q, by_fold(fold_of, gates["folds"], "verify_gate"), held)[ok].mean()),
        "shipped_verify_gate": float(refused(t, q, gates["shipped"]["verify_gate"], shipped)[ok].mean()),
        "registry_gate_0.5": float(refused(t, q, 0.5, shipped)[ok].mean()),
        "reasons_only": float(by_reason[ok].mean()),
    }
    rel, w = reliability_study(q, ps, sim, match_threshold)
    if reliability_out is not None:  # read by quality_reasons.load_reliability
        payload = {
            "format": "facegate.reliability",
            "version": 2,
            "model": "sface",
            "threshold": match_threshold,
            "features": list(RELIABILITY_FEATURES),
            "weights": [float(v) for v in w.weights],
            "isotonic": {"x": [float(v) for v in w.knots_x], "y": [float(v) for v in w.knots_y]},
            "meta": {"command": command},
        }
        Path(reliability_out).write_text(json.dumps(payload, indent=1) + "\n")
    report = {
        "command": command,
        "photos": int(clean.sum()),
        "faces": n,
        "found": float(t["found"].mean()),
        "comparisons": {"genuine": int(ps.same.sum()), "impostor": int((~ps.same).sum())},
        "threshold_fmr_1e-3": match_threshold,
        "calibration_all_pairs": cal,
        "p1": p1,
        "fusion": {k: v for k, v in fus.items() if k != "score"},
        "reasons": reasons,
        "gates": gates,
        "reliability": rel,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    if plot is not None:
        plot_edc(sim[both] < match_threshold, pair_q, plot)
    return report


def plot_edc(fail: np.ndarray, pair_q: dict[str, np.ndarray], path: Path) -> None:
    """EDC curves (FNMR against the fraction discarded, to 30 %) of every method, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, q in pair_q.items():
        x, f = edc_curve(fail, q)
        ax.plot(x[x <= 0.3], f[x <= 0.3], label=m)
    ax.set(xlabel="fraction discarded", ylabel="FNMR", title="P1 EDC (LFW, FMR 1e-3)")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def choose_gate(q_clean: np.ndarray, max_refusal: float) -> float:
    """The largest ``q*`` with ``mean(q_clean < q*) <= max_refusal`` (``q_clean``: clean faces' qualities)."""
    q = np.sort(np.asarray(q_clean, np.float64))
    if q.size == 0:
        return 0.0
    k = math.floor(max_refusal * q.size)  # at most k faces may fall below the gate
    return float(q[k]) if k < q.size else 1.0


def verify_gate(q: np.ndarray, faces: np.ndarray, max_refusal: float, refused_anyway: np.ndarray) -> float:
    """:func:`choose_gate` over ``faces``, refusing only what ``refused_anyway`` (``(N,)`` bool) leaves of the share."""
    rest = faces & ~refused_anyway
    left = max_refusal * faces.sum() - (faces & refused_anyway).sum()
    return choose_gate(q[rest], max(0.0, left) / max(1, rest.sum()))


def _ratio_ci(num: np.ndarray, den: np.ndarray, weights: np.ndarray) -> dict[str, Any]:
    """``sum(num) / sum(den)`` and its 95 % bootstrap interval over the rows of ``weights`` ``(draws, n)``."""
    value = float(num.sum() / den.sum()) if den.any() else float("nan")
    with np.errstate(invalid="ignore", divide="ignore"):
        return ci95(value, (weights @ num.astype(np.float64)) / (weights @ den.astype(np.float64)))


def gate_study(
    q: np.ndarray,
    clean: np.ndarray,
    identity: np.ndarray,
    fold_of_row: np.ndarray,
    ps: PairSet,
    sim: np.ndarray,
    threshold: float,
    refused_anyway: np.ndarray,
    *,
    draws: int = 1000,
) -> dict[str, Any]:
    """Gates chosen per held-out fold, and what they do there. Per face ``(N,)``: ``q`` (0: not found),
    ``clean``, ``identity`` (the bootstrap's unit), ``fold_of_row``; ``sim`` ``(P,)`` per comparison of ``ps``
    (side ``a`` enrolled, ``b`` the probe; −1: a face missing). The verify gate refuses at most
    :data:`VERIFY_MAX_CLEAN` of clean faces together with ``refused_anyway``."""
    rows = []
    for f in sorted(set(ps.fold.tolist())):
        train = clean & (fold_of_row != f) & (q > 0)
        v, e = verify_gate(q, train, VERIFY_MAX_CLEAN, refused_anyway), choose_gate(q[train], ENROL_MAX_CLEAN)
        rows.append({"fold": f, "verify_gate": v, "enrol_gate": e})
    face_gv, face_ge = by_fold(fold_of_row, rows, "verify_gate"), by_fold(fold_of_row, rows, "enrol_gate")
    # a pair's identities lie in its fold (identity_folds), so its gates are those of its faces
    gv, ge = face_gv[ps.a], face_ge[ps.a]
    qa, qb = q[ps.a], q[ps.b]
    out: dict[str, Any] = {"folds": rows, "threshold": threshold}
    weights = identity_weights(identity[ps.a], draws)
    match, same, clean_pair = sim >= threshold, ps.same, ~ps.degraded
    for name, ok in {
        "no_gate": np.ones(len(ps.same), bool),
        "verify": (qa >= gv) & (qb >= gv),
        "search": (qa >= ge) & (qb >= gv),
    }.items():
        out[name] = {
            "genuine_refusal": _ratio_ci(same & ~ok, same, weights),
            "fnmr": _ratio_ci(ok & same & ~match, ok & same, weights),
            "fmr": _ratio_ci(ok & ~same & match, ok & ~same, weights),
            "clean_pair_refusal": _ratio_ci(same & clean_pair & ~ok, same & clean_pair, weights),
        }
    found = q > 0
    out["faces"] = {
        f"{kind}_refused_at_{gate}": float((q[m] < g[m]).mean())
        for kind, m in (("clean", clean & found), ("degraded", ~clean & found))
        for gate, g in (("verify", face_gv), ("enrol", face_ge))
    }
    all_clean = clean & found
    out["shipped"] = {
        "verify_gate": verify_gate(q, all_clean, VERIFY_MAX_CLEAN, refused_anyway),
        "enrol_gate": choose_gate(q[all_clean], ENROL_MAX_CLEAN),
    }
    return out


def ece(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error over ``bins`` equal-width bins of ``p``: ``sum_b |sum_{i in b} (p_i - y_i)| / n``."""
    idx = np.clip(np.digitize(p, np.linspace(0, 1, bins + 1)) - 1, 0, bins - 1)
    return float(np.abs(np.bincount(idx, weights=p - y, minlength=bins)).sum() / p.size)


def isotonic_knots(p: np.ndarray, y: np.ndarray, k: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators (least-squares non-decreasing) fit of ``y`` on ``p``, as ``k`` knots ``(x, y)`` for
    ``np.interp``."""
    o = np.argsort(p)
    blocks: list[tuple[float, int]] = []  # (mean, size) of the pooled runs
    for v in y[o].astype(np.float64).tolist():
        blocks.append((v, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v2, n2), (v1, n1) = blocks.pop(), blocks.pop()
            blocks.append(((v1 * n1 + v2 * n2) / (n1 + n2), n1 + n2))
    means, sizes = zip(*blocks, strict=True)
    fit = np.repeat(np.asarray(means), np.asarray(sizes))
    idx = np.unique(np.linspace(0, o.size - 1, k).astype(int))
    return p[o][idx], fit[idx]


def reliability_study(q: np.ndarray, ps: PairSet, sim: np.ndarray, threshold: float) -> tuple[dict[str, Any], Any]:
    """Cross-fitted reliability on comparisons with both faces found: held-out ECE and Brier per fold, and the
    model fitted on every fold."""
    ok = sim > -1
    x = reliability_features(q[ps.a], q[ps.b], sim, threshold)
    y = ((sim >= threshold) == ps.same).astype(np.float64)

    def fit(m: np.ndarray) -> ReliabilityModel:
        w = fit_logistic_nd(x[m], y[m])
        return ReliabilityModel(w, *isotonic_knots(1.0 / (1.0 + np.exp(-(x[m] @ w))), y[m]))

    p = np.full(sim.size, np.nan)
    rows = []
    for f in sorted(set(ps.fold.tolist())):
        test = ok & (ps.fold == f)
        m = fit(ok & (ps.fold != f))
        p[test] = np.interp(1.0 / (1.0 + np.exp(-(x[test] @ m.weights))), m.knots_x, m.knots_y)
        rows.append({"fold": f, "ece": ece(p[test], y[test]), "brier": float(np.mean((p[test] - y[test]) ** 2))})
    model = fit(ok)
    report = {
        "features": list(RELIABILITY_FEATURES),
        "folds": rows,
        "held_out_ece_mean": float(np.mean([r["ece"] for r in rows])),
        "held_out_ece_pooled": ece(p[ok], y[ok]),
        "held_out_brier_pooled": float(np.mean((p[ok] - y[ok]) ** 2)),
        "verdict_right_rate": float(y[ok].mean()),
        "comparisons": int(ok.sum()),
        "weights": [float(v) for v in model.weights],
    }
    return report, model
