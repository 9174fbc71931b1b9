"""The verify and enrolment gates chosen on held-out folds, and the per-comparison reliability.

A gate is the largest quality ``q*`` that refuses at most a share of the training folds' clean faces (stricter
for enrolment: a poor enrolment hurts every later comparison). Reliability, ``P(verdict right | q_a, q_b, sim)``,
is a logistic regression on :func:`facegate.quality_reasons.reliability_features`, then an isotonic map.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from facegate.eval.p1 import identity_weights
from facegate.eval.quality import PairSet
from facegate.quality_reasons import RELIABILITY_FEATURES, reliability_features

log = logging.getLogger(__name__)

RELIABILITY_FORMAT = "facegate.reliability"


def choose_gate(q_clean: np.ndarray, max_refusal: float) -> float:
    """The largest ``q*`` with ``mean(q_clean < q*) <= max_refusal`` (``q_clean``: clean faces' qualities)."""
    q = np.sort(np.asarray(q_clean, np.float64))
    if q.size == 0:
        return 0.0
    k = math.floor(max_refusal * q.size)  # at most k faces may fall below the gate
    return float(q[k]) if k < q.size else 1.0


def verify_gate(q: np.ndarray, faces: np.ndarray, max_refusal: float, refused_anyway: np.ndarray | None) -> float:
    """:func:`choose_gate` over ``faces``, refusing only what ``refused_anyway`` (``(N,)`` bool) leaves of the share."""
    if refused_anyway is None:
        return choose_gate(q[faces], max_refusal)
    rest = faces & ~refused_anyway
    left = max_refusal * faces.sum() - (faces & refused_anyway).sum()
    return choose_gate(q[rest], max(0.0, left) / max(1, rest.sum()))


def _ratio_ci(num: np.ndarray, den: np.ndarray, weights: np.ndarray) -> dict[str, Any]:
    """``sum(num) / sum(den)`` and its 95 % bootstrap interval over the rows of ``weights`` ``(draws, n)``."""
    value = float(num.sum() / den.sum()) if den.any() else float("nan")
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = (weights @ num.astype(np.float64)) / (weights @ den.astype(np.float64))
    lo, hi = np.nanpercentile(boot, [2.5, 97.5])
    return {"value": value, "ci95": [float(lo), float(hi)]}


def gate_study(
    q: np.ndarray,
    clean: np.ndarray,
    identity: np.ndarray,
    fold_of_row: np.ndarray,
    ps: PairSet,
    sim: np.ndarray,
    threshold: float,
    *,
    verify_max_clean: float = 0.005,
    refused_anyway: np.ndarray | None = None,
    enrol_max_clean: float = 0.02,
    draws: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Gates chosen per held-out fold, and what they do there. Per face ``(N,)``: ``q`` (0: not found),
    ``clean``, ``identity`` (the bootstrap's unit), ``fold_of_row``; ``sim`` ``(P,)`` per comparison of ``ps``
    (side ``a`` enrolled, ``b`` the probe; −1: a face missing)."""
    folds = sorted(set(ps.fold.tolist()))
    gv = np.zeros(len(ps.same))
    ge = np.zeros(len(ps.same))
    rows = []
    face_gv = np.zeros(q.size)
    face_ge = np.zeros(q.size)
    for f in folds:
        train = clean & (fold_of_row != f) & (q > 0)
        v, e = verify_gate(q, train, verify_max_clean, refused_anyway), choose_gate(q[train], enrol_max_clean)
        gv[ps.fold == f], ge[ps.fold == f] = v, e
        face_gv[fold_of_row == f], face_ge[fold_of_row == f] = v, e
        rows.append({"fold": f, "verify_gate": v, "enrol_gate": e})
    qa, qb = q[ps.a], q[ps.b]
    pair_id = identity[ps.a]
    out: dict[str, Any] = {"folds": rows, "threshold": threshold}
    weights = identity_weights(pair_id, draws, seed)
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
        "verify_gate": verify_gate(q, all_clean, verify_max_clean, refused_anyway),
        "enrol_gate": choose_gate(q[all_clean], enrol_max_clean),
    }
    return out


def fit_logistic_nd(x: np.ndarray, y: np.ndarray, *, l2: float = 1e-3, iters: int = 50) -> np.ndarray:
    """Ridge logistic regression by Newton steps: ``(n, k)``, ``(n,)`` in {0, 1} → ``(k,)`` (bias column 0 free)."""
    w = np.zeros(x.shape[1])
    reg = l2 * x.shape[0] * np.eye(x.shape[1])
    reg[0, 0] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        g = x.T @ (p - y) + reg @ w
        h = (x * (p * (1 - p))[:, None]).T @ x + reg + 1e-9 * np.eye(x.shape[1])
        step = np.linalg.solve(h, g)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return w


def ece(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error over ``bins`` equal-width bins of ``p``."""
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(p, edges) - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += m.mean() * abs(p[m].mean() - y[m].mean())
    return float(total)


def isotonic_knots(p: np.ndarray, y: np.ndarray, k: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators fit of ``y`` on ``p``, as ``k`` knots ``(x, y)`` for ``np.interp``."""
    from facegate.models.quality import _pav

    o = np.argsort(p)
    fit = _pav(y[o].astype(np.float64), np.ones(o.size))
    idx = np.unique(np.linspace(0, o.size - 1, k).astype(int))
    return p[o][idx], fit[idx]


def reliability_study(q: np.ndarray, ps: PairSet, sim: np.ndarray, threshold: float) -> tuple[dict[str, Any], Any]:
    """Cross-fitted reliability on comparisons with both faces found: held-out ECE and Brier per fold, and the
    model fitted on every fold."""
    from facegate.quality_reasons import ReliabilityModel

    ok = sim > -1
    x = reliability_features(q[ps.a], q[ps.b], sim, threshold)
    y = ((sim >= threshold) == ps.same).astype(np.float64)

    def fit(m: np.ndarray) -> ReliabilityModel:
        w = fit_logistic_nd(x[m], y[m])
        return ReliabilityModel(w, *isotonic_knots(1.0 / (1.0 + np.exp(-(x[m] @ w))), y[m]))

    def predict(model: ReliabilityModel, m: np.ndarray) -> np.ndarray:
        return np.interp(1.0 / (1.0 + np.exp(-(x[m] @ model.weights))), model.knots_x, model.knots_y)

    p = np.full(sim.size, np.nan)
    rows = []
    for f in sorted(set(ps.fold.tolist())):
        test = ok & (ps.fold == f)
        p[test] = predict(fit(ok & (ps.fold != f)), test)
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


def save_reliability(path: Path, model: Any, *, name: str, threshold: float, meta: dict) -> None:
    """Write a :class:`~facegate.quality_reasons.ReliabilityModel` as JSON (read by ``load_reliability``)."""
    payload = {
        "format": RELIABILITY_FORMAT,
        "version": 2,
        "model": name,
        "threshold": threshold,
        "features": list(RELIABILITY_FEATURES),
        "weights": [float(v) for v in model.weights],
        "isotonic": {"x": [float(v) for v in model.knots_x], "y": [float(v) for v in model.knots_y]},
        "meta": meta,
    }
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")
