"""The one mapping from errors to HTTP responses: ``{"error": {"code", "message", "detail"}}``.

``code`` and the status are the FacegateError subclass's (:mod:`facegate.errors`). Routes raise FacegateErrors
and never build error responses; FastAPI's validation errors become 422 ``invalid_parameter`` and Starlette's
HTTP errors (unknown route, wrong method) keep their status.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from facegate import errors as e
from facegate.errors import FacegateError, InputError, InvalidParameterError, QueueFullError, RateLimitedError
from facegate.logs import escape, redact_paths

log = logging.getLogger(__name__)


def error_body(code: str, message: str, detail: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "detail": dict(detail or {})}}


def facegate_error_response(exc: FacegateError) -> JSONResponse:
    """The HTTP response for a facegate error, with its class's status."""
    status = exc.status
    headers: dict[str, str] = {}
    if isinstance(exc, QueueFullError | RateLimitedError):
        headers["Retry-After"] = str(max(1, math.ceil(float(exc.retry_after_s))))
    if isinstance(exc, e.UnauthorizedError):
        headers["WWW-Authenticate"] = 'Bearer realm="facegate"'

    # 503 (not ready, queue full) can come in floods under load or while polling /readyz: debug only
    level = logging.WARNING if status == 500 else logging.INFO if status == 504 else logging.DEBUG
    if level > logging.DEBUG:  # messages may name subjects (e-mail addresses): those only at DEBUG
        log.log(level, "%s -> %d (%s)", exc.code, status, type(exc).__name__)
    log.debug("%s -> %d: %s", exc.code, status, escape(exc.message))

    def respond(detail: Any) -> JSONResponse:
        content = error_body(exc.code, exc.message, detail)
        # a server-side failure may name server files (the gallery database): never show them
        return JSONResponse(redact_paths(content) if status >= 500 else content, status, headers)

    try:
        return respond(exc.detail)
    except (TypeError, ValueError):  # a detail that is not JSON-serialisable must not turn into a 500
        return respond({"detail": repr(exc.detail)})


def internal_error_response() -> JSONResponse:
    """The JSON 500 of the catch-all (no traceback in the body; the caller logs it)."""
    return JSONResponse(error_body("internal_error", "Internal server error; the server logged the details."), 500)


#: what FastAPI's encoder cannot write as JSON: validation-error details may hold uploads' bytes or exceptions
_SAFE = {bytes: lambda b: f"<{len(b)} bytes>", Exception: str}


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 ``invalid_parameter`` for a request that fails FastAPI's parameter validation."""
    assert isinstance(exc, RequestValidationError)
    kept = [{k: v for k, v in err.items() if k in ("loc", "msg", "type", "ctx")} for err in exc.errors()]
    errors = jsonable_encoder(kept, custom_encoder=_SAFE)
    fields = [".".join(str(p) for p in err.get("loc", ())) for err in errors]
    message = "Invalid request parameters: " + ", ".join(fields) if fields else "Invalid request parameters."
    if "body" in fields and "json" not in request.headers.get("content-type", ""):  # curl -d sends a form's type
        message += "; send the JSON body with the header Content-Type: application/json"
    return JSONResponse(error_body(InvalidParameterError.code, message, {"errors": errors}), status_code=422)


_HTTP_CODES = {400: InputError.code, 404: "not_found", 405: "method_not_allowed", 413: e.ImageTooLargeError.code}


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """JSON form of Starlette's own HTTP errors (unknown route, wrong method, ...)."""
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    return JSONResponse(error_body(code, str(exc.detail)), exc.status_code, getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    """Register FastAPI's and Starlette's errors on ``app``. FacegateErrors (with :func:`facegate_error_response`)
    and the catch-all for other exceptions are in :class:`facegate.api.app.ServingMiddleware`, so that every error
    is answered in one place, logged once and counted in the metrics."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
