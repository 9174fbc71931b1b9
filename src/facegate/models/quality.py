"""Quality heads and calibration maps: a raw model signal (feature norm; RTS ``σ² = exp(logvar)``) → quality in
``[0, 1]``, in torch ops inside the forward; fitted offline (:func:`fit_logistic`) against a binary outcome per
face. Head files are versioned dicts (``torch.save``, read with ``weights_only=True``)."""

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

CalibrationKind = Literal["logistic"]
Transform = Literal["identity", "log"]

HEAD_FORMAT = "facegate.quality_head"
HEAD_VERSION = 1
#: Clamp before ``log``: ``t(raw)`` stays finite for ``raw <= 0``.
LOG_EPS = 1e-12


class QualityHeadError(ModelError):
    """A quality-head file has the wrong format, version, backbone or feature size, or cannot be read."""

    code = "quality_head_invalid"


class QualityCalibration(nn.Module):
    """Monotone map ``raw (N,) → quality (N,)`` float32 in ``[0, 1]``: ``sigmoid(a · t(raw) + b)``, ``t`` identity or
    ``log``, ``sign(a) == direction`` (+1: higher raw is better); NaN maps to 0."""

    def __init__(
        self,
        kind: CalibrationKind = "logistic",
        *,
        direction: int = 1,
        transform: Transform = "identity",
        a: float = 1.0,
        b: float = 0.0,
        fitted: bool = False,
        note: str = "",
    ) -> None:
        super().__init__()
        if kind != "logistic":
            raise InvalidParameterError(f"unknown calibration kind {kind!r}")
        if transform not in ("identity", "log"):
            raise InvalidParameterError(f"unknown calibration transform {transform!r}")
        self.kind: CalibrationKind = kind
        self.transform: Transform = transform
        if direction not in (1, -1):
            raise InvalidParameterError(f"direction must be +1 or -1, got {direction!r}")
        self.direction = int(direction)
        self.fitted = bool(fitted)
        self.note = str(note)
        if not (math.isfinite(a) and math.isfinite(b)):
            raise InvalidParameterError(f"logistic parameters must be finite, got a={a}, b={b}")
        if a != 0 and (1 if a > 0 else -1) != self.direction:
            raise InvalidParameterError(f"logistic slope a={a} disagrees with direction {self.direction}")
        self.register_buffer("a", torch.tensor(float(a), dtype=torch.float32))
        self.register_buffer("b", torch.tensor(float(b), dtype=torch.float32))

    def forward(self, raw: Tensor) -> Tensor:
        """``raw (N,)`` any float dtype → ``quality (N,) float32`` in ``[0, 1]``; NaN → 0."""
        t = torch.log(raw.float().clamp_min(LOG_EPS)) if self.transform == "log" else raw.float()
        return torch.nan_to_num(torch.sigmoid(self.a.float() * t + self.b.float()), nan=0.0).clamp(0.0, 1.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; :meth:`from_dict` inverts it."""
        fields = {k: getattr(self, k) for k in ("kind", "direction", "transform", "fitted", "note")}
        return fields | {"a": float(self.a), "b": float(self.b)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QualityCalibration:
        try:
            return cls(
                d["kind"],
                direction=int(d["direction"]),
                transform=d.get("transform", "identity"),
                a=float(d["a"]),
                b=float(d["b"]),
                fitted=bool(d.get("fitted", False)),
                note=str(d.get("note", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParameterError(f"invalid calibration dict: {exc!r}", detail={"calibration": dict(d)}) from exc


def fit_logistic(
    raw: np.ndarray | list[float], y: np.ndarray | list[float], *, transform: Transform = "identity"
) -> QualityCalibration:
    """``P(y=1 | raw) = sigmoid(a · t(raw) + b)`` by Newton steps on ``raw (n,)``, ``y (n,)`` in ``[0, 1]``, with a
    small ridge on the standardised slope (separable data stay finite)."""
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
    if yy.min() == yy.max():
        raise InvalidParameterError("y has a single class; a logistic calibration needs both outcomes")
    mu, sd = float(t.mean()), float(t.std()) or 1.0
    w = fit_logistic_nd(np.stack([np.ones_like(t), (t - mu) / sd], axis=1), yy, l2=1e-4, iters=100)
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


def sface_head_input(embedding_raw: Tensor, features_flat: Tensor, channels: int = 1024) -> Tensor:
    """What an RTS head reads from SFace: ``(N, D)`` raw embedding, ``(N, C·7·7)`` flattened trunk → the trunk's
    channels average-pooled over the 7×7 grid, then the embedding, ``(N, C + D)`` in the features' dtype (IR-SE-64's
    heads read its flattened features)."""
    pooled = features_flat.reshape(features_flat.shape[0], channels, -1).mean(dim=2)
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


def save_head(path: Path, head: RTSQualityHead, calibration: QualityCalibration, meta: Mapping[str, Any]) -> None:
    """``torch.save`` the head, its calibration and ``meta`` (plain Python values: read with ``weights_only``)."""
    if not head.backbone:
        raise QualityHeadError("save_head needs the backbone arch id (head.backbone)")
    payload = {
        "format": HEAD_FORMAT,
        "version": HEAD_VERSION,
        "backbone": head.backbone,
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


def bn_logvar_calibration(bn: nn.BatchNorm1d, source: str) -> QualityCalibration:
    """Unfitted ``q = sigmoid(−(logvar − β)/|γ|)`` from a head's ``BatchNorm1d(1)`` (on training data ``logvar ≈
    N(β, γ²)``: a typical face lands near 0.5); ``source`` names the head in the note."""
    gamma = abs(float(bn.weight.detach().float().reshape(-1)[0]))
    beta = float(bn.bias.detach().float().reshape(-1)[0])
    gamma = gamma if gamma > 1e-6 else 1.0
    note = f"provisional ({source}): sigmoid(-(logvar - beta)/|gamma|) from the head's BatchNorm1d(1)"
    return QualityCalibration("logistic", direction=-1, transform="log", a=-1.0 / gamma, b=beta / gamma, note=note)
