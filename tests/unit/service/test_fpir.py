"""The 1:N operating point: FPIR ≈ 1 − (1 − FMR(t))^N, from a measured impostor table and its tail model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from facegate.service.fpir import ImpostorTail, operating_points, threshold_for


def synthetic_tail() -> ImpostorTail:
    """FMR(t) = exp(-20 t) measured down to 1e-6 (t = 0.69), the same exponential as the tail model."""
    t = np.linspace(0.0, math.log(1e6) / 20, 200)
    return ImpostorTail(t, np.exp(-20 * t), 1e-6, -20.0, 0.0, "lfw_impostors")


def test_threshold_rises_with_gallery_size_and_meets_the_named_fpir() -> None:
    tail = synthetic_tail()
    prev = -1.0
    for n in (1, 10, 1000, 100_000):
        t, info = threshold_for(tail, n, 1e-2)
        assert t > prev
        prev = t
        assert info["fpir"] == pytest.approx(1e-2, rel=1e-3)
        assert info["fpir"] == pytest.approx(1 - (1 - info["fmr"]) ** n, rel=1e-6)
        assert info["fmr"] == pytest.approx(math.exp(-20 * t), rel=1e-3)  # FMR(t) of the table


def test_beyond_the_measured_fmrs_the_tail_model_is_flagged() -> None:
    tail = synthetic_tail()
    _, inside = threshold_for(tail, 100, 1e-2)  # FMR* ≈ 1e-4: measured
    t, beyond = threshold_for(tail, 100_000, 1e-3)  # FMR* ≈ 1e-8: extrapolated
    assert inside["extrapolated"] is False and beyond["extrapolated"] is True
    assert t == pytest.approx(-math.log(-math.expm1(math.log1p(-1e-3) / 1e5)) / 20, rel=1e-6)
    assert threshold_for(tail, 10**9, 1e-6)[0] == 1.0  # never above the largest cosine
    # an FPIR so small that FMR* = 1 - (1 - FPIR)^(1/N) underflows to 0: the highest threshold, not a math error
    for fpir in (5e-324, 1e-322):
        t, info = threshold_for(tail, 1000, fpir)
        assert t == 1.0 and info["extrapolated"] is True
        assert info["fpir"] == pytest.approx(1 - (1 - math.exp(-20)) ** 1000)  # FMR(1.0) = exp(-20)


def test_registry_point_fallback() -> None:
    tail = ImpostorTail.load("no-such-model", fallback=(0.36, 1e-3))
    t, info = threshold_for(tail, 1000, 1e-2)
    assert t == 0.36 and info["basis"] == "registry_point" and info["extrapolated"] is True
    assert info["fpir"] == pytest.approx(1 - (1 - 1e-3) ** 1000, rel=1e-6)  # 63 %: it says so
    rows = operating_points(synthetic_tail(), (100, 1000), (1e-2, 1e-3))
    assert len(rows) == 4 and all(r["threshold"] > 0 for r in rows)
