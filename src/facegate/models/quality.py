"""Quality heads and calibration maps: a raw model signal (feature norm; RTS ``σ² = exp(logvar)``) → quality in
``[0, 1]``, in torch ops inside the forward; fitted offline (:func:`fit_logistic`, :func:`fit_isotonic`) against a
binary outcome per face. Head files are versioned dicts (``torch.save``, read with ``weights_only=True``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from facegate.errors import InvalidParameterError, ModelError

log = logging.getLogger(__name__)

CalibrationKind = Literal["logistic", "piecewise_linear"]
Transform = Literal["identity", "log"]

HEAD_FORMAT = "facegate.quality_head"
HEAD_VERSION = 1
#: Clamp before ``log``: ``t(raw)`` stays finite for ``raw <= 0``.
LOG_EPS = 1e-12


class QualityHeadError(ModelError):
    """A quality-head file has the wrong format, version, backbone or feature size, or cannot be read."""

    code = "quality_head_invalid"


def _check_direction(direction: int) -> int:
    if direction not in (1, -1):
        raise InvalidParameterError(f"direction must be +1 or -1, got {direction!r}")
    return int(direction)


class QualityCalibration(nn.Module):
    """Monotone map ``raw (N,) → quality (N,)`` float32 in ``[0, 1]``; NaN maps to 0. ``logistic``: ``sigmoid(a ·
    t(raw) + b)``, ``sign(a) == direction``; ``piecewise_linear``: ascending knots ``xs`` (in ``t`` units), ``ys`` in
    ``[0, 1]``, constant beyond the ends. ``t``: identity or ``log``. ``direction`` +1: higher raw is better."""

    def __init__(
        self,
        kind: CalibrationKind = "logistic",
        *,
        direction: int = 1,
        transform: Transform = "identity",
        a: float = 1.0,
        b: float = 0.0,
        xs: list[float] | np.ndarray | None = None,
        ys: list[float] | np.ndarray | None = None,
        fitted: bool = False,
        note: str = "",
    ) -> None:
        super().__init__()
        if kind not in ("logistic", "piecewise_linear"):
            raise InvalidParameterError(f"unknown calibration kind {kind!r}")
        if transform not in ("identity", "log"):
            raise InvalidParameterError(f"unknown calibration transform {transform!r}")
        self.kind: CalibrationKind = kind
        self.transform: Transform = transform
        self.direction = _check_direction(direction)
        self.fitted = bool(fitted)
        self.note = str(note)
        if kind == "logistic":
            if not (math.isfinite(a) and math.isfinite(b)):
                raise InvalidParameterError(f"logistic parameters must be finite, got a={a}, b={b}")
            if a != 0 and (1 if a > 0 else -1) != self.direction:
                raise InvalidParameterError(f"logistic slope a={a} disagrees with direction {self.direction}")
            xs_t, ys_t = torch.zeros(0), torch.zeros(0)
        else:
            xs_t = torch.as_tensor(np.asarray(xs if xs is not None else [], dtype=np.float64), dtype=torch.float32)
            ys_t = torch.as_tensor(np.asarray(ys if ys is not None else [], dtype=np.float64), dtype=torch.float32)
            self._validate_knots(xs_t, ys_t, self.direction)
            if xs_t.numel() == 1:  # a constant map; two equal-valued knots keep forward branch-free
                xs_t = torch.cat([xs_t, xs_t + 1.0])
                ys_t = torch.cat([ys_t, ys_t])
        self.register_buffer("a", torch.tensor(float(a), dtype=torch.float32))
        self.register_buffer("b", torch.tensor(float(b), dtype=torch.float32))
        self.register_buffer("xs", xs_t)
        self.register_buffer("ys", ys_t)

    @staticmethod
    def _validate_knots(xs: Tensor, ys: Tensor, direction: int) -> None:
        ok = xs.ndim == ys.ndim == 1 and xs.numel() == ys.numel() >= 1
        ok = ok and bool(torch.isfinite(xs).all() and torch.isfinite(ys).all() and (ys >= 0).all() and (ys <= 1).all())
        ok = ok and bool((xs[1:] > xs[:-1]).all() and (direction * (ys[1:] - ys[:-1]) >= -1e-6).all())
        if not ok:
            raise InvalidParameterError(
                f"piecewise_linear needs finite, strictly ascending xs and ys in [0, 1] monotone in {direction:+d}"
            )

    def forward(self, raw: Tensor) -> Tensor:
        """``raw (N,)`` any float dtype → ``quality (N,) float32`` in ``[0, 1]``; NaN → 0."""
        t = torch.log(raw.float().clamp_min(LOG_EPS)) if self.transform == "log" else raw.float()
        if self.kind == "logistic":
            q = torch.sigmoid(self.a.float() * t + self.b.float())
        else:
            xs, ys = self.xs.float(), self.ys.float()
            idx = torch.searchsorted(xs, t.contiguous(), right=True).clamp(1, xs.numel() - 1)
            x0, x1 = xs[idx - 1], xs[idx]
            y0, y1 = ys[idx - 1], ys[idx]
            w = ((t - x0) / (x1 - x0)).clamp(0.0, 1.0)
            q = y0 + w * (y1 - y0)
        q = torch.where(torch.isnan(q), torch.zeros_like(q), q)
        return q.clamp(0.0, 1.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; :meth:`from_dict` inverts it."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "direction": self.direction,
            "transform": self.transform,
            "fitted": self.fitted,
            "note": self.note,
        }
        if self.kind == "logistic":
            out.update(a=float(self.a), b=float(self.b))
        else:
            out.update(xs=[float(v) for v in self.xs], ys=[float(v) for v in self.ys])
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QualityCalibration:
        try:
            kind = d["kind"]
            common = {
                "direction": int(d["direction"]),
                "transform": d.get("transform", "identity"),
                "fitted": bool(d.get("fitted", False)),
                "note": str(d.get("note", "")),
            }
            if kind == "logistic":
                return cls("logistic", a=float(d["a"]), b=float(d["b"]), **common)
            return cls(kind, xs=list(d["xs"]), ys=list(d["ys"]), **common)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParameterError(f"invalid calibration dict: {exc!r}", detail={"calibration": dict(d)}) from exc


def _prepare(
    raw: np.ndarray | list[float], y: np.ndarray | list[float], transform: Transform
) -> tuple[np.ndarray, np.ndarray]:
    r = np.asarray(raw, dtype=np.float64).ravel()
    yy = np.asarray(y, dtype=np.float64).ravel()
    if r.shape != yy.shape:
        raise InvalidParameterError(f"raw and y differ in length ({r.size} vs {yy.size})")
    if r.size < 2:
        raise InvalidParameterError("need at least 2 samples to fit a calibration")
    if not (np.isfinite(r).all() and np.isfinite(yy).all()):
        raise InvalidParameterError("raw and y must be finite")
    if ((yy < 0) | (yy > 1)).any():
        raise InvalidParameterError("y must lie in [0, 1] (a binary outcome or a rate)")
    t = np.log(np.maximum(r, LOG_EPS)) if transform == "log" else r
    return t, yy


def fit_logistic(
    raw: np.ndarray | list[float],
    y: np.ndarray | list[float],
    *,
    transform: Transform = "identity",
    l2: float = 1e-4,
    max_iter: int = 100,
) -> QualityCalibration:
    """``P(y=1 | raw) = sigmoid(a · t(raw) + b)`` by Newton steps on ``raw (n,)``, ``y (n,)`` in ``[0, 1]``; ``l2``:
    a ridge on the standardised slope (separable data stay finite)."""
    t, yy = _prepare(raw, y, transform)
    if yy.min() == yy.max():
        raise InvalidParameterError("y has a single class; a logistic calibration needs both outcomes")
    mu, sd = float(t.mean()), float(t.std())
    sd = sd if sd > 0 else 1.0
    w = fit_logistic_nd(np.stack([np.ones_like(t), (t - mu) / sd], axis=1), yy, l2=l2, iters=max_iter)
    a = float(w[1] / sd)
    b = float(w[0] - w[1] * mu / sd)
    direction = -1 if a < 0 else 1
    log.info("fit_logistic: a=%.6g b=%.6g direction=%+d (n=%d)", a, b, direction, t.size)
    kw = {"direction": direction, "transform": transform, "fitted": True, "note": f"fit_logistic n={t.size}"}
    return QualityCalibration("logistic", a=a, b=b, **kw)


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


def pav(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Pool-adjacent-violators: the weighted least-squares non-decreasing fit of ``y``."""
    vals: list[float] = []
    wts: list[float] = []
    counts: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist(), strict=True):
        vals.append(yi)
        wts.append(wi)
        counts.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v2, w2, c2 = vals.pop(), wts.pop(), counts.pop()
            v1, w1, c1 = vals.pop(), wts.pop(), counts.pop()
            ww = w1 + w2
            vals.append((v1 * w1 + v2 * w2) / ww)
            wts.append(ww)
            counts.append(c1 + c2)
    return np.repeat(np.asarray(vals), np.asarray(counts))


def fit_isotonic(
    raw: np.ndarray | list[float],
    y: np.ndarray | list[float],
    *,
    transform: Transform = "identity",
    direction: int | None = None,
) -> QualityCalibration:
    """Isotonic regression of ``y (n,)`` on ``t(raw (n,))`` as knots (flat runs keep their ends); ``direction=None``
    fits both and keeps the smaller squared error."""
    t, yy = _prepare(raw, y, transform)
    order = np.argsort(t, kind="stable")
    ux, inv, cnt = np.unique(t[order], return_inverse=True, return_counts=True)
    ymean = np.bincount(inv, weights=yy[order]) / cnt
    w = cnt.astype(np.float64)

    def fit(d: int) -> tuple[np.ndarray, float]:
        fy = pav(ymean, w) if d == 1 else pav(ymean[::-1], w[::-1])[::-1]
        return fy, float((w * (fy - ymean) ** 2).sum())

    if direction is None:
        (fy_p, e_p), (fy_m, e_m) = fit(1), fit(-1)
        direction, fy = (1, fy_p) if e_p <= e_m else (-1, fy_m)
    else:
        direction = _check_direction(direction)
        fy, _ = fit(direction)
    keep = np.ones(ux.size, dtype=bool)
    if ux.size > 2:
        flat_prev = np.isclose(fy[1:-1], fy[:-2], rtol=0, atol=1e-12)
        flat_next = np.isclose(fy[1:-1], fy[2:], rtol=0, atol=1e-12)
        keep[1:-1] = ~(flat_prev & flat_next)
    xs, ys = ux[keep], np.clip(fy[keep], 0.0, 1.0)
    log.info("fit_isotonic: %d knots, direction=%+d (n=%d)", xs.size, direction, t.size)
    kw = {"direction": direction, "transform": transform, "fitted": True, "note": f"fit_isotonic n={t.size}"}
    return QualityCalibration("piecewise_linear", xs=xs, ys=ys, **kw)


def sface_head_input(embedding_raw: Tensor, features_flat: Tensor, channels: int = 1024) -> Tensor:
    """What an RTS head reads from SFace: ``(N, D)`` raw embedding, ``(N, C·7·7)`` flattened trunk → the trunk's
    channels average-pooled over the 7×7 grid, then the embedding, ``(N, C + D)`` in the features' dtype (IR-SE-64's
    heads read its flattened features)."""
    n = features_flat.shape[0]
    pooled = features_flat.reshape(n, channels, -1).mean(dim=2)
    return torch.cat([pooled, embedding_raw.to(pooled.dtype)], dim=1)


class RTSQualityHead(nn.Module):
    """RTS head ``Linear + BatchNorm1d(1)``: ``(N, feature_dim) → logvar (N, 1)``; ``backbone``: the arch it reads."""

    def __init__(self, feature_dim: int, *, backbone: str = "") -> None:
        super().__init__()
        self.feature_dim = int(feature_dim)
        self.backbone = str(backbone)
        self.fc = nn.Linear(self.feature_dim, 1)
        self.bn = nn.BatchNorm1d(1)

    def forward(self, features: Tensor) -> Tensor:
        return self.bn(self.fc(features))

    def sigma2(self, features: Tensor) -> Tensor:
        """``σ² = exp(logvar)``: ``(N, feature_dim) → (N,)``."""
        return torch.exp(self(features)).squeeze(1)


def save_head(
    path: Path,
    head: RTSQualityHead,
    calibration: QualityCalibration,
    meta: Mapping[str, Any],
    *,
    backbone: str | None = None,
) -> None:
    """``torch.save`` the head, its calibration and ``meta`` (plain Python values: read with ``weights_only``)."""
    path = Path(path)
    backbone = head.backbone if backbone is None else str(backbone)
    if not backbone:
        raise QualityHeadError("save_head needs the backbone arch id (head.backbone or backbone=...)")
    payload = {
        "format": HEAD_FORMAT,
        "version": HEAD_VERSION,
        "backbone": backbone,
        "feature_dim": int(head.feature_dim),
        "state_dict": {k: v.detach().cpu().clone() for k, v in head.state_dict().items()},
        "calibration": calibration.to_dict(),
        "meta": dict(meta),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.save(payload, path)
    except (OSError, RuntimeError) as exc:
        raise QualityHeadError(f"cannot write quality head {path}: {exc}", detail={"path": str(path)}) from exc


def load_head(
    path: Path, *, backbone: str | None = None, feature_dim: int | None = None
) -> tuple[RTSQualityHead, QualityCalibration, dict[str, Any]]:
    """``(head (eval, fp32, CPU), calibration, meta)`` of a :func:`save_head` file; :class:`QualityHeadError` if
    unreadable or of another format, version, ``backbone`` or ``feature_dim``."""
    path = Path(path)
    det: dict[str, Any] = {"path": str(path)}
    if not path.is_file():
        raise QualityHeadError(f"quality head {path} does not exist", detail=det)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle/zip/EOF errors from torch.load
        raise QualityHeadError(f"cannot read quality head {path}: {type(exc).__name__}: {exc}", detail=det) from exc
    d = obj if isinstance(obj, dict) else {"format": type(obj).__name__}
    got, fd, trained_on = d.get("format"), d.get("feature_dim"), d.get("backbone")
    problems = [
        (got != HEAD_FORMAT, f"is not a facegate quality head (format {got!r}, expected {HEAD_FORMAT!r})"),
        (d.get("version") != HEAD_VERSION, f"quality head version {d.get('version')!r} is not supported"),
        (backbone is not None and trained_on != backbone, f"was trained on backbone {trained_on!r}, not {backbone!r}"),
        (not isinstance(fd, int) or fd < 1, f"has an invalid feature_dim {fd!r}"),
        (feature_dim is not None and fd != feature_dim, f"expects {fd}-dim features, the backbone gives {feature_dim}"),
    ]
    for bad, msg in problems:
        if bad:
            raise QualityHeadError(f"{path} {msg}", detail=det)
    head = RTSQualityHead(fd, backbone=str(obj.get("backbone", "")))
    try:
        head.load_state_dict(obj.get("state_dict"), strict=True)  # type: ignore[arg-type]
        calibration = QualityCalibration.from_dict(obj.get("calibration") or {})
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise QualityHeadError(f"{path}: head state_dict does not fit: {exc}", detail=det) from exc
    except InvalidParameterError as exc:
        raise QualityHeadError(f"{path}: {exc.message}", detail=det) from exc
    return head.float().eval(), calibration, dict(obj.get("meta") or {})


def bn_logvar_calibration(bn: nn.BatchNorm1d, note: str) -> QualityCalibration:
    """Unfitted ``q = sigmoid(−(logvar − β)/|γ|)`` from a head's ``BatchNorm1d(1)`` (on training data ``logvar ≈
    N(β, γ²)``: a typical face lands near 0.5)."""
    gamma = abs(float(bn.weight.detach().float().reshape(-1)[0]))
    beta = float(bn.bias.detach().float().reshape(-1)[0])
    gamma = gamma if gamma > 1e-6 else 1.0
    return QualityCalibration(
        "logistic", direction=-1, transform="log", a=-1.0 / gamma, b=beta / gamma, fitted=False, note=note
    )
