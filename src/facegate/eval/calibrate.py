"""The match threshold at a false-match rate, over all pairs of the embedded images.

LFW's 3,000 impostor pairs allow 3 false matches at FMR 1e-3: too noisy. Every pair of different people is an
impostor comparison here (millions), every pair of one person a genuine one; the threshold at FMR ``f`` is the
``1 − f`` quantile of the impostor scores.
"""

from __future__ import annotations

import numpy as np

from facegate.eval.lfw import threshold_at_fmr


def all_pair_scores(emb: np.ndarray, ids: np.ndarray, *, chunk: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """``(genuine, impostor)`` float32 scores of all pairs ``i < j`` of ``emb`` ``(N, D)`` (NaN rows skipped)."""
    ok = ~np.isnan(emb).any(axis=1)
    e = emb[ok].astype(np.float32)
    lab = np.unique(ids[ok], return_inverse=True)[1]
    gen, imp = [], []
    for s in range(0, len(e), chunk):
        block = e[s : s + chunk] @ e.T  # (b, N)
        rows = np.arange(s, min(s + chunk, len(e)))
        upper = np.arange(len(e))[None, :] > rows[:, None]
        same = lab[rows][:, None] == lab[None, :]
        gen.append(block[upper & same])
        imp.append(block[upper & ~same])
    return np.concatenate(gen), np.concatenate(imp)


def calibrate(emb: np.ndarray, ids: np.ndarray, fmrs: tuple[float, ...] = (1e-3, 1e-4)) -> dict[str, object]:
    """Thresholds at each FMR over all-pairs impostors (:func:`~facegate.eval.lfw.threshold_at_fmr`: the measured
    FMR never exceeds the target), with the FNMR they give on all genuine pairs."""
    gen, imp = all_pair_scores(emb, ids)
    points = []
    for f in fmrs:
        t = threshold_at_fmr(imp, f)
        fmr, fnmr = float(np.mean(imp >= t)), float(np.mean(gen < t))
        points.append({"fmr_target": f, "threshold": t, "fmr_measured": fmr, "fnmr": fnmr})
    return {"genuine_pairs": int(gen.size), "impostor_pairs": int(imp.size), "points": points}
