"""The landmark residual the low_confidence benchmark measures: alignment's similarity fit error."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from facegate.pipeline.align import ARCFACE_TEMPLATE, umeyama
from lowconf_analysis import landmark_residual


def _similar(points: np.ndarray, scale: float, deg: float, shift: tuple[float, float]) -> np.ndarray:
    th = np.radians(deg)
    rot = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    return scale * np.asarray(points, np.float64) @ rot.T + np.asarray(shift)


def test_landmark_residual_is_alignments_fit_error() -> None:
    # any rotated, scaled, shifted template fits exactly
    assert landmark_residual(_similar(ARCFACE_TEMPLATE, 3.1, 25.0, (400.0, -30.0))) < 1e-9
    rng = np.random.default_rng(3)
    for _ in range(5):
        lm = _similar(ARCFACE_TEMPLATE + rng.normal(0, 4, (5, 2)), rng.uniform(0.5, 4), rng.uniform(-40, 40), (80, 90))
        m = umeyama(lm[None], ARCFACE_TEMPLATE)[0]
        want = np.sqrt(np.mean(np.sum((lm @ m[:, :2].T + m[:, 2] - ARCFACE_TEMPLATE) ** 2, axis=1)))
        assert landmark_residual(lm) == pytest.approx(want, rel=1e-6)
