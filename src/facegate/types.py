"""Frozen result types shared by every stage.

Arrays are NumPy on the host. Shapes and dtypes are part of the contract and are stated per field.
Landmark order everywhere is the YuNet/ArcFace order, in *image* coordinates:
``0`` right eye (image left), ``1`` left eye, ``2`` nose tip, ``3`` right mouth corner, ``4`` left mouth corner.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum

import numpy as np


class FaceSelect(StrEnum):
    """Which detected faces a call keeps."""

    LARGEST = "largest"  #: the face with the largest box area
    ALL = "all"  #: every face, sorted by score (desc)


@dataclass(frozen=True, slots=True)
class Detection:
    """One detected face, in source-image pixels."""

    box: np.ndarray  # (4,) float32: x1, y1, x2, y2
    landmarks: np.ndarray  # (5, 2) float32 (x, y), in the order of the module docstring
    score: float  # detector confidence in [0, 1]
    photo_wh: tuple[int, int] | None = None  # (width, height) of the photo it was found in, pixels; None: unknown

    @property
    def area(self) -> float:
        """Box area in square pixels."""
        return float(max(0.0, self.box[2] - self.box[0]) * max(0.0, self.box[3] - self.box[1]))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (rounded to 0.01 px)."""
        box, landmarks = np.round(self.box.astype(np.float64), 2), np.round(self.landmarks.astype(np.float64), 2)
        return {"box": box.tolist(), "landmarks": landmarks.tolist(), "score": round(float(self.score), 5)}


@dataclass(frozen=True, slots=True)
class QualityReason:
    """One cause of a poor face, as a measured value against its limit (:mod:`facegate.quality_reasons`)."""

    code: str  # too_small, pose, blur, too_dark, too_bright, occluded, low_confidence, out_of_distribution, ...
    message: str  # what a person reads, e.g. "face too small (38 px between the eyes, 60 needed)"
    value: float  # the measured value, in the code's unit (pixels, degrees, grey level, fraction, score)
    threshold: float  # the limit it missed

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "value": round(float(self.value), 4), "threshold": round(float(self.threshold), 4)}


@dataclass(frozen=True, slots=True)
class QualityVerdict:
    """The quality gate's decision for one face."""

    score: float  # calibrated quality in [0, 1], higher is better
    raw: float  # the model's quality signal before calibration (model-specific units)
    threshold: float  # the gate the score was compared with
    accepted: bool  # score >= threshold and (when reasons refuse) no reason found
    reason: str | None = None  # None when accepted, else the refusal a person reads ("retake: ...")
    reasons: tuple[QualityReason, ...] = ()  # every cause of a poor face found

    def to_dict(self) -> dict[str, object]:
        out = {"score": round(float(self.score), 5), "raw": round(float(self.raw), 6), "threshold": self.threshold}
        return out | {"accepted": self.accepted, "reason": self.reason, "reasons": [r.to_dict() for r in self.reasons]}


@dataclass(frozen=True, slots=True)
class Face:
    """One face that went through the whole pipeline."""

    detection: Detection | None  # None for a pre-aligned crop
    embedding: np.ndarray  # (D,) float32, L2-normalised
    quality: QualityVerdict
    crop: np.ndarray | None = field(default=None, repr=False)  # (112, 112, 3) uint8 RGB aligned crop, if kept

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form, without the embedding."""
        det = None if self.detection is None else self.detection.to_dict()
        return {"detection": det, "quality": self.quality.to_dict()}


@dataclass(frozen=True, slots=True)
class CompareResult:
    """Outcome of a 1:1 comparison; a pair the quality gate refuses is never compared."""

    similarity: float | None  # cosine in [-1, 1]; None when refused
    threshold: float  # the match threshold used
    fmr: float  # the false-match rate it was calibrated to (e.g. 1e-3)
    match: bool | None  # None when refused
    faces: tuple[Face, Face]
    refused: bool
    reason: str | None = None  # why it was refused
    reliability: float | None = None  # calibrated P(match is right) from both qualities; None: refused or no fit
