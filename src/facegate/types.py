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
    INDEX = "index"  #: one face by position in the score-sorted list (needs ``face_index``)


@dataclass(frozen=True, slots=True)
class Detection:
    """One detected face.

    Attributes:
        box: ``(4,) float32`` ``x1, y1, x2, y2`` in source-image pixels.
        landmarks: ``(5, 2) float32`` ``(x, y)`` in source-image pixels, order in the module docstring.
        score: detector confidence in ``[0, 1]``.
    """

    box: np.ndarray
    landmarks: np.ndarray
    score: float

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
    """One cause of a poor face, as a measured value against its limit.

    Attributes:
        code: stable identifier (``too_small``, ``pose``, ``blur``, ``too_dark``, ``too_bright``, ``occluded``,
            ``low_confidence``, ``out_of_distribution``).
        message: what a person reads, e.g. ``face too small (38 px between the eyes, 60 needed)``.
        value: the measured value (units per code: pixels, degrees, Laplacian variance, grey level, fraction,
            detector score, quality score).
        threshold: the limit it missed.
    """

    code: str
    message: str
    value: float
    threshold: float

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "value": round(float(self.value), 4), "threshold": round(float(self.threshold), 4)}


@dataclass(frozen=True, slots=True)
class QualityVerdict:
    """The quality gate's decision for one face.

    Attributes:
        score: calibrated quality in ``[0, 1]`` (higher is better).
        raw: the model's raw quality signal before calibration (model-specific units).
        threshold: the gate's threshold the score was compared with.
        accepted: ``score >= threshold`` and no reason given.
        reason: ``None`` when accepted, else a human-readable refusal ("retake: ...") naming the reasons.
        reasons: every cause of a poor face found (empty for a good one).
    """

    score: float
    raw: float
    threshold: float
    accepted: bool
    reason: str | None = None
    reasons: tuple[QualityReason, ...] = ()

    def to_dict(self) -> dict[str, object]:
        out = {"score": round(float(self.score), 5), "raw": round(float(self.raw), 6), "threshold": self.threshold}
        return out | {"accepted": self.accepted, "reason": self.reason, "reasons": [r.to_dict() for r in self.reasons]}


@dataclass(frozen=True, slots=True)
class Face:
    """One face that went through the whole pipeline.

    Attributes:
        detection: where it was found; ``None`` for pre-aligned crops.
        embedding: ``(D,) float32``, L2-normalised.
        quality: the gate's verdict.
        crop: ``(112, 112, 3) uint8`` RGB aligned crop, or ``None`` when not kept.
    """

    detection: Detection | None
    embedding: np.ndarray
    quality: QualityVerdict
    crop: np.ndarray | None = field(default=None, repr=False)

    def to_dict(self, *, with_embedding: bool = False) -> dict[str, object]:
        """JSON-ready form; the embedding is included only on request."""
        det = None if self.detection is None else self.detection.to_dict()
        out: dict[str, object] = {"detection": det, "quality": self.quality.to_dict()}
        if with_embedding:
            out["embedding"] = [round(float(v), 7) for v in self.embedding]
        return out


@dataclass(frozen=True, slots=True)
class CompareResult:
    """Outcome of a 1:1 comparison.

    Attributes:
        similarity: cosine similarity of the two embeddings in ``[-1, 1]``; ``None`` when refused.
        threshold: the match threshold used.
        fmr: the false-match rate that threshold was calibrated to (e.g. ``1e-3``).
        match: ``True``/``False``; ``None`` when refused (a refused pair is never compared).
        faces: the two faces.
        refused: whether the quality gate refused the comparison.
        reason: refusal reason, ``None`` if compared.
        reliability: calibrated probability that ``match`` is right, given both qualities and the similarity;
            ``None`` when refused or when the model has no reliability fit.
    """

    similarity: float | None
    threshold: float
    fmr: float
    match: bool | None
    faces: tuple[Face, Face]
    refused: bool
    reason: str | None = None
    reliability: float | None = None
