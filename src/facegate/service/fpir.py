"""The 1:N operating point (docs/gallery.md): the search threshold for a named false-positive identification rate,
``FMR* = 1 − (1 − FPIR)^(1/N)`` at gallery size N, with FMR(t) from the model's LFW impostor table
(:data:`IMPOSTOR_DIR`/``<model>.json``) and its tail model beyond it, else the registry calibration point.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMPOSTOR_DIR = Path(__file__).resolve().parents[1] / "models" / "impostors"
DEFAULT_FPIR = 1e-2  # when the request names none


@dataclass(frozen=True, slots=True)
class ImpostorTail:
    """FMR(t) of one model: measured at ``(m,)`` increasing ``thresholds`` (``fmr`` decreasing, down to
    ``min_measured_fmr``), below that the tail model ``log FMR(t) = intercept + slope·t`` (slope < 0).
    ``basis``: ``"lfw_impostors"`` (a measured table) or ``"registry_point"`` (one calibrated point)."""

    thresholds: np.ndarray
    fmr: np.ndarray
    min_measured_fmr: float
    slope: float
    intercept: float
    basis: str

    @classmethod
    def load(cls, model: str, *, fallback: tuple[float, float]) -> ImpostorTail:
        """The shipped table of ``model``; without one, ``fallback=(threshold, fmr)`` (the registry point)."""
        path = IMPOSTOR_DIR / f"{model}.json"
        if path.is_file():
            d = json.loads(path.read_text())
            return cls(
                thresholds=np.asarray(d["thresholds"], np.float64),
                fmr=np.asarray(d["fmr"], np.float64),
                min_measured_fmr=float(d["min_measured_fmr"]),
                slope=float(d["tail"]["slope"]),
                intercept=float(d["tail"]["intercept"]),
                basis="lfw_impostors",
            )
        t, f = fallback
        return cls(np.array([t]), np.array([f]), float(f), float("nan"), float("nan"), "registry_point")

    def fmr_at(self, t: float) -> tuple[float, bool]:
        """``(FMR(t), extrapolated)``."""
        if self.basis == "registry_point":
            return float(self.fmr[0]), True
        if t <= self.thresholds[-1]:
            return float(np.exp(np.interp(t, self.thresholds, np.log(self.fmr)))), False
        return float(math.exp(self.intercept + self.slope * t)), True

    def threshold_at(self, fmr: float) -> tuple[float, bool]:
        """``(t, extrapolated)`` with ``FMR(t) = fmr``."""
        if self.basis == "registry_point":
            return float(self.thresholds[0]), True
        if fmr >= self.min_measured_fmr:
            # np.interp needs increasing x: log FMR decreases along the thresholds
            return float(np.interp(math.log(fmr), np.log(self.fmr[::-1]), self.thresholds[::-1])), False
        return float((math.log(fmr) - self.intercept) / self.slope), True


def threshold_for(tail: ImpostorTail, n: int, fpir: float) -> tuple[float, dict[str, object]]:
    """The threshold for a named FPIR in ``(0, 1)`` (the route checks it) at gallery size ``n`` (``n < 1`` counts
    as 1), and what it rests on: ``{"fpir", "fmr", "n", "extrapolated", "basis"}`` where ``fpir`` is the FPIR the
    threshold gives."""
    n_eff = max(1, int(n))
    # a named FPIR near the smallest double underflows FMR* to 0 at n > 1: take the smallest positive FMR
    t, ext = tail.threshold_at(max(-math.expm1(math.log1p(-float(fpir)) / n_eff), math.ulp(0.0)))
    t = min(max(t, -1.0), 1.0)
    fmr, ext2 = tail.fmr_at(t)
    achieved = float(-math.expm1(n_eff * math.log1p(-min(fmr, 1 - 1e-16))))  # FPIR = 1 - (1 - FMR)^N
    return t, {"fpir": achieved, "fmr": fmr, "n": int(n), "extrapolated": ext or ext2, "basis": tail.basis}


def operating_points(tail: ImpostorTail, sizes: tuple[int, ...], fpirs: tuple[float, ...]) -> list[dict[str, object]]:
    """A table of thresholds by gallery size and FPIR (for ``facegate models``)."""
    rows = []
    for n in sizes:
        for f in fpirs:
            t, info = threshold_for(tail, n, f)
            rows.append({"n": n, "fpir_target": f, "threshold": round(t, 4), **info})
    return rows
