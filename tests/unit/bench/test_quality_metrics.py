"""benchmarks/quality_metrics.py, P1's EDC metrics, on small hand-checked cases and a synthetic set where the ordering
of methods is known."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from quality_metrics import edc_curve, metrics, pauc, per_face_oracle, study


def test_curve_and_areas_by_hand() -> None:
    fail = np.array([True, False, False, False])
    x, f = edc_curve(fail, np.array([0.1, 0.5, 0.6, 0.7]))
    np.testing.assert_allclose(x, [0, 0.25, 0.5, 0.75])
    np.testing.assert_allclose(f, [0.25, 0, 0, 0])
    assert pauc(x, f, 0.2) == pytest.approx(0.25)  # the first step is 0.25 wide: FNMR 0.25 over [0, 0.2]
    assert pauc(x, f, 0.5) == pytest.approx(0.25 * 0.25 / 0.5)
    assert metrics(fail, (~fail).astype(float))["fnmr5"] == pytest.approx(0.25)  # 5 % of 4 comparisons discards none


def test_per_face_oracle_is_a_floor_of_min() -> None:
    a, b = np.array([0, 0, 1]), np.array([1, 2, 3])
    sim = np.array([0.9, 0.2, 0.5])
    got = per_face_oracle(a, b, sim)
    np.testing.assert_allclose(got, [0.2, 0.2, 0.5])
    assert (got <= sim).all()


def test_study_orders_oracle_norm_and_random() -> None:
    rng = np.random.default_rng(0)
    n = 2000
    q_true = rng.random(n)
    fail = rng.random(n) < 0.3 * (1 - q_true) ** 3
    noisy = q_true + rng.normal(0, 0.3, n)
    ident = rng.integers(0, 200, n)
    res = study(fail, {"feature_norm": noisy, "oracle": (~fail).astype(float) + 0.01 * q_true}, ident, draws=50)
    assert res["oracle"]["E"]["pauc20"] == pytest.approx(0.0, abs=1e-9)
    assert 0.0 < res["feature_norm"]["E"]["pauc20"] < 1.0
    assert abs(res["random"]["E"]["pauc20"] - 1.0) < 1e-9
    _lo, hi = res["oracle"]["pauc20_minus_feature_norm"]["ci95"]
    assert hi < 0  # the oracle is significantly better than the noisy score
    assert metrics(fail, noisy)["pauc10"] >= res["best"]["raw"]["pauc10"]
