"""Calibrate the match threshold to a named false-match rate on many impostor comparisons.

The 3,000 impostor pairs of the LFW protocol allow only 3 false matches at FMR 1e-3, which makes a
threshold estimated from them noisy. Here every pair of images of *different* people among the
embedded images is an impostor comparison (about 29.6 million for the 7,701 LFW pair images), and
every pair of images of the same person is a genuine one. The threshold at FMR ``f`` is the
``1 − f`` quantile of the impostor scores; FNMR at that threshold is reported on the genuine ones.
"""

from __future__ import annotations

import numpy as np


def identity_of(path: str) -> str:
    """LFW identity from ``Name/Name_0001.jpg``."""
    return path.split("/", 1)[0]


def all_pair_scores(emb: np.ndarray, ids: np.ndarray, *, chunk: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """Scores of all unordered pairs ``i < j``: (genuine scores, impostor scores), float32.

    ``emb``: ``(N, D)`` L2-normalised; rows with NaN are skipped. ``ids``: ``(N,)`` identity labels.
    """
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
    """Thresholds at each FMR over all-pairs impostors, with the FNMR they give on all genuine pairs."""
    gen, imp = all_pair_scores(emb, ids)
    out: dict[str, object] = {"genuine_pairs": int(gen.size), "impostor_pairs": int(imp.size), "points": []}
    imp_sorted = np.sort(imp)
    for f in fmrs:
        k = int(np.ceil((1.0 - f) * imp_sorted.size))
        t = float(imp_sorted[min(k, imp_sorted.size - 1)])
        out["points"].append(  # type: ignore[union-attr]
            {
                "fmr_target": f,
                "threshold": t,
                "fmr_measured": float(np.mean(imp >= t)),
                "fnmr": float(np.mean(gen < t)),
            }
        )
    return out
