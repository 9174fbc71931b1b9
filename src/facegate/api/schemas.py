"""Pydantic models of the HTTP API (v1, docs/dev/http-api.md). Keys sent only on request (a face's ``crop`` and
``embedding``, an embed item's ``faces``/``error``) stay unset when absent, and the routes exclude unset keys;
keys always sent (``detection``, ``reason``) are always set, ``None`` included.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import cv2
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from facegate.service.gallery import SearchHit
from facegate.types import CompareResult, Face


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorInfo(_Model):
    """One error: stable ``code`` (from :mod:`facegate.errors`), human ``message``, structured ``detail``."""

    code: str
    message: str
    detail: dict[str, Any] = Field(default_factory=dict)


class ErrorResponse(_Model):
    """Body of every non-2xx JSON response."""

    error: ErrorInfo


class DetectionOut(_Model):
    """A detected face: ``box`` x1,y1,x2,y2 and 5 ``landmarks`` (x, y) in source-image pixels."""

    box: list[float] = Field(min_length=4, max_length=4)
    landmarks: list[list[float]] = Field(min_length=5, max_length=5)
    score: float


class ReasonOut(_Model):
    """One cause of a poor face: a measured value against its limit."""

    code: str = Field(
        description="too_small, pose, blur, too_dark, too_bright, occluded, low_confidence or out_of_distribution"
    )
    message: str = Field(
        description="what to tell the person, e.g. 'face too small (38 px between the eyes, 24 needed)'"
    )
    value: float = Field(description="the measured value (pixels, degrees, sharpness, brightness, fraction, score)")
    threshold: float = Field(description="the limit it missed")


class QualityOut(_Model):
    """The quality gate's verdict for one face."""

    score: float
    raw: float
    threshold: float
    accepted: bool
    reason: str | None
    reasons: list[ReasonOut] = Field(description="every cause of a poor face found (empty for a good face)")


class FaceOut(_Model):
    """One face with its quality verdict; ``crop`` only with ``crops=true``, ``embedding`` only in embed."""

    detection: DetectionOut | None
    quality: QualityOut
    crop: str | None = Field(None, description="data:image/png;base64 aligned 112×112 crop (crops=true only)")
    embedding: list[float] | None = Field(None, description="L2-normalised embedding (/api/embed only)")

    @classmethod
    def from_face(cls, face: Face, *, crops: bool = False, embedding: bool = False) -> FaceOut:
        kw: dict[str, Any] = face.to_dict()  # detection and quality
        if crops and face.crop is not None:  # (112, 112, 3) uint8 RGB → PNG data URL (cannot fail on uint8)
            _, png = cv2.imencode(".png", np.ascontiguousarray(face.crop[:, :, ::-1]))
            kw["crop"] = "data:image/png;base64," + base64.b64encode(png.tobytes()).decode("ascii")
        if embedding:
            # 7 decimals keep the JSON short; numpy rounds a whole vector at once (round() per float is 10× dearer)
            kw["embedding"] = np.round(np.asarray(face.embedding, dtype=np.float32).astype(np.float64), 7).tolist()
        return cls(**kw)


Verdict = Literal["match", "no_match", "refused"]


class CompareResponse(_Model):
    """1:1 comparison. ``similarity``/``match`` are ``null`` when the quality gate refused the pair."""

    similarity: float | None
    match: bool | None
    verdict: Verdict
    threshold: float
    fmr: float
    refused: bool
    reason: str | None
    reliability: float | None = Field(
        description="calibrated probability that the verdict is right, given both faces' qualities and the "
        "similarity (for a 1:1 mix of genuine and impostor comparisons); null when refused"
    )
    faces: list[FaceOut] = Field(min_length=2, max_length=2)
    model: str

    @classmethod
    def from_result(cls, r: CompareResult, *, model: str, crops: bool = False) -> CompareResponse:
        return cls(
            similarity=None if r.similarity is None else round(float(r.similarity), 6),
            match=r.match,
            verdict="refused" if r.refused else ("match" if r.match else "no_match"),
            threshold=float(r.threshold),
            fmr=float(r.fmr),
            refused=bool(r.refused),
            reason=r.reason,
            reliability=None if r.reliability is None else round(float(r.reliability), 4),
            faces=[FaceOut.from_face(f, crops=crops) for f in r.faces],
            model=model,
        )


class EmbedItem(_Model):
    """One input image's outcome: either ``faces`` (each with its ``embedding``) or an ``error``."""

    index: int
    faces: list[FaceOut] | None = None
    error: ErrorInfo | None = None


class EmbedResponse(_Model):
    """Per-image results, in input order; one bad image does not fail the others."""

    model: str
    dim: int
    results: list[EmbedItem]


class DetectResponse(_Model):
    """Detections in source-image pixels, sorted by score."""

    faces: list[DetectionOut]
    width: int
    height: int


class CreateGalleryRequest(_Model):
    """Body of ``POST /api/galleries``."""

    name: str = Field(description="1-64 characters of A-Z a-z 0-9 _ . -, not '.' or '..' (checked by the gallery)")


class BatchEnrolResponse(_Model):
    """Answer of ``POST /api/galleries/{name}/enrolments``: the subjects written and the images refused."""

    enrolled: list[SubjectOut]
    refused: list[BatchRefusal]


class ImportTemplatesRequest(_Model):
    """Body of ``POST /api/galleries/{name}/templates``: bulk enrolment without photos."""

    subject_ids: list[str] = Field(min_length=1, max_length=10_000, description="one id per template, unique")
    embeddings: list[list[float]] = Field(description="one template per id, of the gallery's dimension")
    qualities: list[float] | None = Field(None, description="calibrated qualities in [0, 1]; default 1")


class ImportTemplatesResponse(_Model):
    """Answer of ``POST /api/galleries/{name}/templates``."""

    imported: int


class GalleryOut(_Model):
    """A gallery: the model and embedding dimension it was built with, and its subject count."""

    name: str
    model: str
    dim: int
    subjects: int
    created_at: float = Field(description="Unix seconds (UTC)")


class GalleryListResponse(_Model):
    """All galleries."""

    galleries: list[GalleryOut]


class Deleted(_Model):
    """Answer of a ``DELETE``: the gallery's name or the subject's id."""

    deleted: str


class SubjectOut(_Model):
    """An enrolled subject (:class:`facegate.gallery.base.SubjectInfo`)."""

    subject_id: str
    n_embeddings: int = Field(description="number of stored embeddings the template is built from")
    template_quality: float = Field(description="best calibrated quality among them, in [0, 1]")
    meta: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(description="first enrolment, Unix seconds")
    updated_at: float = Field(description="last write, Unix seconds")


class RefusedImage(_Model):
    """An enrolment image that was not used, and why."""

    index: int
    reason: str
    code: str | None = None


class BatchRefusal(RefusedImage):
    """An image of a batch enrolment that was not used, whose subject it shows, and why."""

    subject_id: str


class EnrolResponse(_Model):
    """``POST /api/galleries/{name}/subjects/{subject_id}``."""

    subject: SubjectOut
    accepted: int
    refused: list[RefusedImage]


class SubjectListResponse(_Model):
    """A page of subjects and the gallery's total count."""

    subjects: list[SubjectOut]
    total: int


class SearchResponse(_Model):
    """1:N search. A probe below the quality gate is refused and never searched (``hits`` empty)."""

    face: FaceOut
    refused: bool
    reason: str | None
    hits: list[SearchHit]
    threshold: float = Field(description="cosine similarity a hit must reach to be a match")
    fmr: float = Field(description="the threshold's false-match rate per comparison")
    fpir: float = Field(description="the threshold's false-positive identification rate at gallery size n")
    n: int = Field(description="subjects in the gallery when it was searched")
    extrapolated: bool = Field(description="FMR(threshold) lies beyond what the LFW impostor pairs measured")


class HealthResponse(_Model):
    """``GET /healthz``."""

    status: Literal["ok"] = "ok"


class ReadyResponse(_Model):
    """``GET /readyz`` once models are loaded and warmed."""

    status: Literal["ready"] = "ready"
    model: str
    device: str
    precision: str
