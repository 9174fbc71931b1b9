"""Gallery policy shared by the HTTP API and the command line: enrolment accept/refuse, and the 1:N threshold
from a named FPIR at the gallery's current size (:mod:`facegate.service.fpir`); search runs on the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from facegate.errors import FacegateError, QualityRejectedError
from facegate.gallery.base import GalleryInfo, GalleryStore, SearchHit
from facegate.service.fpir import DEFAULT_FPIR, ImpostorTail, threshold_for
from facegate.types import QualityVerdict


@dataclass(frozen=True, slots=True)
class Refusal:
    """One enrolment image that was not used: its position, why, and the error code."""

    index: int
    reason: str
    code: str | None


@dataclass(frozen=True, slots=True)
class EnrolDecision:
    """The faces of an enrolment request to enrol, the images refused, and (nothing accepted) the error."""

    accepted: list[Any]
    refused: list[Refusal]
    error: FacegateError | None

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """``(k, D) float32`` embeddings and ``(k,) float32`` qualities of the accepted faces."""
        emb = np.stack([f.embedding for f in self.accepted]).astype(np.float32)
        return emb, np.asarray([f.quality.score for f in self.accepted], dtype=np.float32)


def decide_enrolments(
    subject_ids: Sequence[str],
    results: Sequence[Any],
    *,
    verdict: Callable[[Any], QualityVerdict] | None,
    stats: Any = None,
) -> list[tuple[str, list[int], EnrolDecision]]:
    """The enrolment gate per subject of a request whose image ``i`` shows ``subject_ids[i]`` (``results[i]``: a
    Face or the FacegateError of that image), in order of first appearance: each subject, its images' indices and
    its decision. A face is refused when ``verdict(face)`` (the pipeline's ``enrol_verdict``; None: every face is
    enrolled) refuses it; such refusals are counted in ``stats`` (a :class:`~facegate.metrics.stats.ServiceStats`,
    if given) as ``enrol_low_quality``. A subject with nothing accepted gets QualityRejectedError (when any refusal
    was the gate's, or there were no errors) or its first image's error, with every refusal in its detail."""
    rows: dict[str, list[int]] = {}
    for i, sid in enumerate(subject_ids):
        rows.setdefault(sid, []).append(i)
    decisions = []
    for sid, idx in rows.items():
        accepted: list[Any] = []
        refused: list[Refusal] = []
        errors: list[FacegateError] = []
        for i, r in enumerate(results[j] for j in idx):
            if isinstance(r, FacegateError):
                errors.append(r)
                refused.append(Refusal(i, r.message, r.code))
            elif isinstance(r, BaseException):
                raise r
            elif verdict is not None and not (v := verdict(r)).accepted:
                refused.append(Refusal(i, v.reason, QualityRejectedError.code))
                if stats is not None:
                    stats.refusals.labels("enrol_low_quality").inc()
            else:
                accepted.append(r)
        error: FacegateError | None = None
        if not accepted:
            detail = {"refused": [asdict(x) for x in refused]}
            if any(x.code == QualityRejectedError.code for x in refused) or not errors:
                error = QualityRejectedError(
                    f"no image of {sid!r} has a face that passes the quality gate; retake", detail=detail
                )
            else:
                error = errors[0]
                error.detail = {**error.detail, **detail}
        decisions.append((sid, idx, EnrolDecision(accepted, refused, error)))
    return decisions


class GalleryFront:
    """The front-end's gallery: the store of record for writes and reads, the engine (``face_service``, a
    :class:`~facegate.service.faces.FaceService`) for search, and the FPIR operating point. Callers check with
    :meth:`check_model` that the gallery's model made the embeddings they pass (the store only checks ``dim``)."""

    def __init__(self, store: GalleryStore, face_service: Any) -> None:
        self.store = store
        self._svc = face_service
        op = face_service.pipeline.operating  # the engine's calibration point, for a model without a table
        spec = face_service.spec
        self.tail = ImpostorTail.load(spec.impostors or spec.name, fallback=(op.match_threshold, op.match_fmr))

    def check_model(self, info: GalleryInfo) -> None:
        """A gallery of another model's embeddings cannot be enrolled into or searched (409)."""
        info.check_model(self._svc.spec.name, self._svc.spec.embedding_dim)

    async def search_face(
        self, gallery: str, face: Any, k: int, fpir: float | None = None, *, found: Any = None, size: int = 0
    ) -> tuple[list[SearchHit], dict[str, object]]:
        """The 1:N policy for one probe ``face``: its hits (scores rounded to 6 decimals) and operating point, the
        match ``threshold`` with :func:`~facegate.service.fpir.threshold_for`'s account of it. A face the quality
        gate refused is never searched (no hits, at gallery size ``size``, counted as ``search_low_quality``);
        otherwise its hits come from ``found`` (the engine's :class:`~facegate.pipeline.search.SearchOut` of a photo
        search) or from a search of its embedding, with the threshold for ``fpir`` (default :data:`DEFAULT_FPIR`) at
        the size the gallery had when searched. The caller refuses a bad ``fpir`` first."""
        stats = self._svc.stats
        fpir = DEFAULT_FPIR if fpir is None else fpir
        if not face.quality.accepted:
            stats.refusals.labels("search_low_quality").inc()
            t, point = threshold_for(self.tail, size, fpir)
            return [], {"threshold": t, **point}
        if found is None:
            found = await self._svc.search(gallery, np.asarray(face.embedding, np.float32), k)
        t, point = threshold_for(self.tail, found.size, fpir)
        stats.gallery_subjects.labels(gallery).set(found.size)
        ranked = enumerate(zip(found.subject_ids, found.scores, strict=True))
        hits = [SearchHit(r + 1, sid, round(float(s), 6), bool(s >= t)) for r, (sid, s) in ranked]
        return hits, {"threshold": t, **point}
