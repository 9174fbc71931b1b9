"""EDC metrics of protocol P1 over genuine comparisons with both faces found (the others are failure to
acquire): pAUC at 20 % and 10 % discard and FNMR at 5 %, raw, minus the theoretical best, and as
E = (pAUC − best) / (random − best), with a paired bootstrap over identities against a reference method.

Pair quality is ``min(q_a, q_b)``, ties broken at random (seeded). The best discards the failing comparisons
first; the pair oracle discards by similarity; the per-face oracle scores a face by its lowest genuine similarity;
random averages uniform scores over 20 seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

DISCARDS = {"pauc20": 0.20, "pauc10": 0.10}
FNMR_AT = 0.05
#: P1 leaves out comparisons with a side degraded beyond this severity; pAUC differences are against this method
MAX_SEVERITY = 3
REFERENCE = "feature_norm"


def _edc(fail: np.ndarray, pair_q: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per row of weights ``w`` ``(draws, n)`` (a comparison drawn ``k`` times counts ``k`` times): the discarded
    fraction before and after each comparison, lowest quality first, and the FNMR of those kept."""
    order = np.lexsort((np.random.default_rng(0).random(fail.size), pair_q))  # ascending: discarded first
    w, f = w[:, order].astype(np.float64), fail[order].astype(np.float64)
    tot = w.sum(1, keepdims=True)
    cw = np.cumsum(w, 1)
    fail_left = (w * f).sum(1, keepdims=True) - np.cumsum(w * f, 1) + w * f
    return (cw - w) / tot, cw / tot, fail_left / np.maximum(tot - cw + w, 1e-12)


def edc_curve(fail: np.ndarray, pair_q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x, fnmr)`` step curve after discarding the ``k`` lowest of ``pair_q`` ``(n,)``, ``k = 0..n-1``;
    ``fail``: ``(n,)`` bool, the comparison fails at the threshold."""
    x, _, fnmr = _edc(fail, pair_q, np.ones((1, fail.size)))
    return x[0], fnmr[0]


def pauc(x: np.ndarray, fnmr: np.ndarray, x_max: float) -> float:
    """Mean FNMR over discard fractions ``[0, x_max]`` of the step curve (FNMR units)."""
    return float(_area(x, np.append(x[1:], 1.0), fnmr, x_max))


def _area(start: np.ndarray, end: np.ndarray, fnmr: np.ndarray, x_max: float) -> np.ndarray:
    return (np.clip(np.minimum(end, x_max) - start, 0.0, None) * fnmr).sum(-1) / x_max


def metrics(fail: np.ndarray, pair_q: np.ndarray) -> dict[str, float]:
    """pAUC@20 %, pAUC@10 % and FNMR at 5 % discard of one pair quality."""
    x, f = edc_curve(fail, pair_q)
    out = {k: pauc(x, f, v) for k, v in DISCARDS.items()}
    out["fnmr5"] = float(f[max(0, int(np.searchsorted(x, FNMR_AT, side="right")) - 1)])
    return out


def per_face_oracle(face_a: np.ndarray, face_b: np.ndarray, sim: np.ndarray) -> np.ndarray:
    """Per comparison ``min(o_a, o_b)`` where a face's ``o`` is the lowest similarity of its comparisons."""
    n_faces = int(max(face_a.max(initial=-1), face_b.max(initial=-1))) + 1
    low = np.full(n_faces, np.inf)
    np.minimum.at(low, face_a, sim)
    np.minimum.at(low, face_b, sim)
    return np.minimum(low[face_a], low[face_b])


def identity_weights(identity: np.ndarray, draws: int) -> np.ndarray:
    """``(draws, n)`` float32: how often each comparison's identity was drawn (with replacement, as many draws)."""
    uniq, inv = np.unique(identity, return_inverse=True)
    counts = np.random.default_rng(0).multinomial(uniq.size, np.full(uniq.size, 1.0 / uniq.size), size=draws)
    return counts[:, inv].astype(np.float32)


def ci95(value: float, boot: np.ndarray) -> dict[str, Any]:
    """``value`` with the 95 % interval of its bootstrap draws ``boot`` (NaN draws left out)."""
    lo, hi = np.nanpercentile(boot, [2.5, 97.5])
    return {"value": value, "ci95": [float(lo), float(hi)]}


def study(
    fail: np.ndarray, scores: Mapping[str, np.ndarray], identity: np.ndarray, draws: int
) -> dict[str, dict[str, object]]:
    """Every method's metrics (raw, minus the best, E) and a bootstrap over ``identity`` ``(n,)`` of its pAUC@20
    difference from :data:`REFERENCE`. ``fail``: ``(n,)`` bool; ``scores``: method → ``(n,)`` pair quality."""
    best = metrics(fail, (~fail).astype(np.float64))  # the theoretical best: failures discarded first
    rand = [metrics(fail, np.random.default_rng(1000 + k).random(fail.size)) for k in range(20)]
    random_mean = {k: float(np.mean([r[k] for r in rand])) for k in best}
    raw = {name: metrics(fail, q) for name, q in scores.items()}
    raw["random"] = random_mean
    weights = identity_weights(identity, draws)
    boot = {name: _area(*_edc(fail, q, weights), DISCARDS["pauc20"]) for name, q in scores.items()}  # (draws,)
    diffs = {name: b - boot[REFERENCE] for name, b in boot.items() if name != REFERENCE}
    out: dict[str, dict[str, object]] = {}
    for name, m in raw.items():
        row: dict[str, object] = {
            "raw": m,
            "minus_best": {k: m[k] - best[k] for k in m},
            "E": {k: (m[k] - best[k]) / (random_mean[k] - best[k]) if random_mean[k] > best[k] else None for k in m},
        }
        if name in diffs:
            row[f"pauc20_minus_{REFERENCE}"] = ci95(m["pauc20"] - raw[REFERENCE]["pauc20"], diffs[name])
        out[name] = row
    out["best"] = {"raw": best}
    return out


def p1_report(
    *,
    a: np.ndarray,
    b: np.ndarray,
    same: np.ndarray,
    found: np.ndarray,
    severity: np.ndarray,
    degradation: np.ndarray,
    identity: np.ndarray,
    sim: np.ndarray,
    face_scores: Mapping[str, np.ndarray],
    threshold: float,
    threshold_check: float | None = None,
    draws: int = 1000,
) -> dict[str, object]:
    """P1 over comparisons ``a``, ``b`` ``(P,)`` (face rows), ``same`` and ``sim`` ``(P,)``; ``found``,
    ``severity`` (0: clean), ``degradation``, ``identity`` and ``face_scores`` (method → quality) per face row.
    ``threshold``: FMR 1e-3, ``threshold_check``: a second one; sides above :data:`MAX_SEVERITY` are left out."""
    keep = same & (severity[a] <= MAX_SEVERITY) & (severity[b] <= MAX_SEVERITY)
    both = keep & found[a] & found[b]
    out: dict[str, object] = {
        "genuine_comparisons": int(keep.sum()),
        "failure_to_acquire": float(1.0 - both.sum() / max(1, keep.sum())),
        "max_severity": MAX_SEVERITY,
        "threshold": threshold,
    }
    ia, ib, s = a[both], b[both], sim[both]
    pair_q = {m: np.minimum(v[ia], v[ib]) for m, v in face_scores.items()}
    pair_q["pair_oracle"] = s
    pair_q["per_face_oracle"] = per_face_oracle(ia, ib, s)
    ident = identity[ia]
    fail = s < threshold

    def sub(m: np.ndarray, n_draws: int) -> dict[str, dict[str, object]]:
        return study(fail[m], {k: v[m] for k, v in pair_q.items()}, ident[m], draws=n_draws)

    out["fnmr_at_0"] = float(fail.mean()) if fail.size else None
    out["all"] = study(fail, pair_q, ident, draws=draws)
    clean = (severity[ia] == 0) & (severity[ib] == 0)
    out["clean_only"] = sub(clean, max(1, draws // 5))
    side = np.where(severity[ia] > 0, degradation[ia], degradation[ib])
    names = sorted(set(side[~clean].tolist()))
    out["by_degradation"] = {name: sub(side == name, 200) for name in names if (side == name).sum() >= 20}
    if threshold_check is not None:
        f4 = s < threshold_check
        out["check_threshold"] = threshold_check
        out["check"] = {k: metrics(f4, v) for k, v in pair_q.items()}
    return out
