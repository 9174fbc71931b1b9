"""All-pairs threshold calibration to a named FMR."""

from __future__ import annotations

import numpy as np

from facegate.eval.calibrate import all_pair_scores, calibrate


def test_all_pair_scores_counts_and_calibration() -> None:
    rng = np.random.default_rng(0)
    n_id, per = 60, 4
    centres = rng.normal(size=(n_id, 16))
    emb = np.repeat(centres, per, axis=0) + 0.3 * rng.normal(size=(n_id * per, 16))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    ids = np.repeat(np.arange(n_id).astype(str), per)
    emb[5] = np.nan  # a face that was not found is skipped
    gen, imp = all_pair_scores(emb.astype(np.float32), ids, chunk=37)
    n = n_id * per - 1
    assert gen.size + imp.size == n * (n - 1) // 2
    assert gen.size == (n_id - 1) * per * (per - 1) // 2 + 3
    res = calibrate(emb.astype(np.float32), ids, fmrs=(1e-2,))
    point = res["points"][0]
    assert point["fmr_measured"] <= 1e-2 + 1e-9
    assert 0.0 <= point["fnmr"] < 0.5
    assert res["impostor_pairs"] == imp.size


def test_calibration_never_exceeds_its_fmr_on_ties() -> None:
    """Three people, two identical photos each, orthogonal to one another: every impostor scores 0. A threshold of
    0 would match them all (FMR 1); the calibrated one matches none and every genuine pair."""
    emb = np.repeat(np.eye(3, 8, dtype=np.float32), 2, axis=0)
    point = calibrate(emb, np.repeat(np.array(["a", "b", "c"]), 2), fmrs=(1e-1,))["points"][0]
    assert point["threshold"] > 0.0 and point["fmr_measured"] == 0.0 and point["fnmr"] == 0.0, point
