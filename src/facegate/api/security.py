"""Who may call the API and what a browser may do with it: API keys, Host and Origin checks, rate limits,
security headers, the OpenAPI security scheme and the offline API docs.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import ipaddress
import logging
import re
import time
from base64 import b64encode
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.types import Message, Send
from starlette.types import Scope as AsgiScope

from facegate.config import Settings
from facegate.errors import (
    FacegateError,
    ForbiddenError,
    HostNotAllowedError,
    OriginNotAllowedError,
    RateLimitedError,
    ServerError,
    UnauthorizedError,
)
from facegate.service.keys import ApiKey, KeyStore, Scope

log = logging.getLogger(__name__)


_ROUTE_SCOPES: list[tuple[frozenset[str], re.Pattern[str], Scope]] = [
    (frozenset({"POST"}), re.compile(r"^/api/(compare|detect|embed)/?$"), "read"),
    (frozenset({"POST"}), re.compile(r"^/api/galleries/[^/]+/search/?$"), "read"),
    (frozenset({"GET", "HEAD"}), re.compile(r"^/api/galleries/?$"), "read"),
    (frozenset({"GET", "HEAD"}), re.compile(r"^/api/galleries/[^/]+/subjects/?$"), "enrol"),
    (frozenset({"POST", "DELETE"}), re.compile(r"^/api/galleries/[^/]+/subjects/[^/]+/?$"), "enrol"),
]
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def required_scope(method: str, path: str, settings: Settings) -> Scope | None:
    """The scope ``method path`` needs, or ``None`` for an open route. Unlisted ``/api`` routes need ``admin``."""
    if path.startswith("/api/"):
        for methods, pattern, scope in _ROUTE_SCOPES:
            if method in methods and pattern.match(path):
                return scope
        return "admin"
    if path.rstrip("/") == "/metrics" and settings.security.metrics_access == "key":
        return "read"
    return None


_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether a bind address is loopback-only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    try:
        return host.strip("[]") == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """``Host`` header value → lower-case host without the port (``[::1]:80`` → ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def check_bind(settings: Settings, keys: KeyStore) -> None:
    """Refuse (ServerError) a non-loopback address without API keys unless ``security.no_auth``; log how it runs."""
    if len(keys):
        log.info("API keys: %d configured (%s); /api routes need one", len(keys), keys.path.name)
        return
    if settings.security.no_auth:
        log.warning(
            "authentication is OFF (--no-auth): anyone who reaches %s may enrol, delete and search", settings.host
        )
        return
    if not is_loopback(settings.host):
        raise ServerError(
            f"refusing to listen on {settings.host} without API keys: create one with `facegate keys create "
            "--scope read` (keys live in the data folder), or pass --no-auth to serve without authentication",
            detail={"host": settings.host},
        )
    log.warning("no API keys configured: authentication is off; listening on loopback (%s) only", settings.host)


class TokenBuckets:
    """Token buckets by client identity (at most ``max_clients`` tracked; the least recently seen go first)."""

    def __init__(self, rate_per_s: float, burst: int, max_clients: int = 10_000) -> None:
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.max_clients = max_clients
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def take(self, who: str, now: float | None = None) -> float:
        """Take one token for ``who``: 0.0 when allowed, else the seconds until a token is there."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.pop(who, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
        self._buckets[who] = (tokens - 1.0 if wait == 0.0 else tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait


def presented_key(headers: Headers) -> str | None:
    """The API key of a request: ``Authorization: Bearer <key>``, else ``X-API-Key``."""
    kind, _, token = headers.get("authorization", "").strip().partition(" ")
    if kind.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip() or None


_PROBES = frozenset({"/healthz", "/readyz"})


class Access:
    """Before any body is read, refuses a ``Host`` not allowed or repeated (400: DNS rebinding), a state-changing
    method from a foreign ``Origin`` or ``Sec-Fetch-Site: cross-site`` (403: a cross-site form needs no preflight),
    no or an unknown key, or none configured on a non-loopback address (401), a key without the route's scope
    (403), a client past its token bucket (429)."""

    def __init__(self, settings: Settings, keys: KeyStore) -> None:
        self.settings, self.keys = settings, keys
        self.loopback = is_loopback(settings.host)
        sec = settings.security
        self.hosts: frozenset[str] | None = None  # the Host values accepted (lower case, without port; None: any)
        if sec.allowed_hosts and "*" not in sec.allowed_hosts:
            self.hosts = frozenset(_host_name(h) for h in sec.allowed_hosts)
        elif not sec.allowed_hosts and self.loopback:
            self.hosts = _LOOPBACK_NAMES | {settings.host.lower()}
        self.origins = frozenset(o.rstrip("/").lower() for o in sec.allowed_origins)
        self.buckets = TokenBuckets(sec.rate_limit_per_s, sec.rate_limit_burst) if sec.rate_limit_per_s else None

    def refusal(self, scope: AsgiScope) -> FacegateError | None:
        """Why an HTTP request is refused (400, 401, 403 or 429), or ``None``; reads no body."""
        method, path, headers = scope["method"], scope["path"], Headers(scope=scope)
        host = headers.get("host", "")
        if (n_hosts := len(headers.getlist("host"))) > 1:  # which one would a proxy route by?
            return HostNotAllowedError("a request may carry only one Host header", detail={"host_headers": n_hosts})
        # the health probes answer any Host: orchestrators and container checks ask by address, and they reveal nothing
        if self.hosts is not None and _host_name(host) not in self.hosts and path not in _PROBES:
            return HostNotAllowedError(
                "this server does not answer for the host named in the Host header",
                detail={"allowed": sorted(self.hosts)},
            )
        if method in _STATE_CHANGING and (refused := self._origin_refusal(headers, host)) is not None:
            return refused
        if (scope_needed := required_scope(method, path, self.settings)) is None:
            return None
        key: ApiKey | None = None
        if not self.settings.security.no_auth and not len(self.keys) and not self.loopback:
            # every key revoked while serving, or a process that never ran check_bind (a Ray ingress): not open
            return UnauthorizedError(
                "this server has no API keys and listens on a non-loopback address: it refuses every /api request "
                "until a key is created (`facegate keys create`)",
                detail={"scope": scope_needed},
            )
        if not self.settings.security.no_auth and len(self.keys):
            if (token := presented_key(headers)) is None:
                return UnauthorizedError(
                    "this route needs an API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`",
                    detail={"scope": scope_needed},
                )
            key = self.keys.verify(token)
            if key is None:
                return UnauthorizedError(
                    "the API key is not valid (unknown or revoked)", detail={"scope": scope_needed}
                )
            if not key.allows(scope_needed):
                return ForbiddenError(
                    f"the API key {key.id} lacks the scope {scope_needed!r} this route needs"
                    + (" (admin: also any method or path the API does not have)" if scope_needed == "admin" else ""),
                    detail={"scope": scope_needed, "key_scopes": list(key.scopes), "key": key.id},
                )
        if self.buckets is not None and path.startswith("/api/"):
            who = f"key:{key.id}" if key is not None else f"addr:{(scope.get('client') or ('?',))[0]}"
            if (wait := self.buckets.take(who)) > 0.0:
                return RateLimitedError(
                    f"rate limit of {self.buckets.rate:g} requests/s exceeded; retry in {wait:.2f} s",
                    retry_after_s=wait,
                    detail={"retry_after_s": round(wait, 3), "rate_per_s": self.buckets.rate},
                )
        return None

    def _origin_refusal(self, headers: Headers, host: str) -> OriginNotAllowedError | None:
        origin = headers.get("origin", "")
        if not origin:
            # no Origin: not a browser's cross-site request, unless the browser says so (old forms, some redirects)
            if headers.get("sec-fetch-site", "").lower() == "cross-site":
                return OriginNotAllowedError(
                    "cross-site requests may not change state", detail={"sec_fetch_site": "cross-site"}
                )
            return None
        normal = origin.strip().rstrip("/").lower()
        with contextlib.suppress(ValueError):  # not a URL (``http://[::1``): not this server's page
            if normal in self.origins or (normal != "null" and urlsplit(normal).netloc == host.strip().lower()):
                return None  # an allowed origin, or the page this server served
        return OriginNotAllowedError(
            "requests that change state must come from this server's own pages or an allowed origin",
            detail={"allowed": sorted(self.origins)},
        )


#: The policy of every response: own-origin resources only (images may be data:/blob: URLs), no framing.
CSP = (
    "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'"
)
#: The other headers of every response.
FIXED_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


def with_security_headers(send: Send, csp: str) -> Send:
    """``send`` that puts the policy ``csp``, X-Frame-Options, nosniff and Referrer-Policy on the response."""
    policy = (b"content-security-policy", csp.encode())

    async def with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != policy[0]]
            message["headers"] = [*headers, policy, *FIXED_HEADERS]
        await send(message)

    return with_headers


DOCS_ASSETS = "/docs-assets"


def install_docs(app: FastAPI) -> dict[str, str]:
    """``/docs`` (Swagger UI) and ``/redoc`` from packaged assets; returns each page's CSP (with the hash of
    its inline script, so that no other inline script runs)."""
    swagger = get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="facegate API",
        swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        swagger_ui_parameters={"validatorUrl": None, "persistAuthorization": False},
    ).body.decode()
    redoc = get_redoc_html(
        openapi_url="/openapi.json",
        title="facegate API",
        redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
        redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        with_google_fonts=False,
    ).body.decode()
    inline = re.findall(r"<script>(.*?)</script>", swagger, flags=re.S)

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return HTMLResponse(swagger)

    @app.get("/redoc", include_in_schema=False)
    async def redoc_ui() -> HTMLResponse:
        return HTMLResponse(redoc)

    import fastapi_offline  # Swagger UI and ReDoc files (MIT)

    assets = Path(fastapi_offline.__file__).resolve().parent / "static"
    app.mount(DOCS_ASSETS, StaticFiles(directory=assets), name="docs-assets")
    base = "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; frame-ancestors 'none'"
    hashes = " ".join(f"'sha256-{b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in inline)
    return {
        "/docs": f"{base}; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline'",
        "/redoc": f"{base}; script-src 'self'; style-src 'self' 'unsafe-inline'; worker-src 'self' blob:",
    }


def install_openapi_security(app: FastAPI, settings: Settings) -> None:
    """Declare the two ways to send a key in OpenAPI, and each operation's need of one."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # which FastAPI caches in app.openapi_schema
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "`facegate keys create`"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
        }
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                needed = required_scope(method.upper(), path, settings)
                op["security"] = [] if needed is None else [{"bearer": []}, {"apiKey": []}]
                if needed is not None:
                    op["description"] = (op.get("description") or "") + f"\n\nAPI key scope: `{needed}`."
                    for status, what in (("401", "no or unknown API key"), ("403", "key lacks the scope, or origin")):
                        op.setdefault("responses", {}).setdefault(status, {"description": what, "content": error})
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
