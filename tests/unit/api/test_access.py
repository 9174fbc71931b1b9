"""Access checks of the HTTP front-end (facegate.api.security.Access) on ASGI scopes, no server."""

from __future__ import annotations

from pathlib import Path

from facegate.api.security import Access
from facegate.config import Settings
from facegate.errors import HostNotAllowedError, UnauthorizedError
from facegate.service.keys import KeyStore


def _scope(method: str, path: str, host: str = "10.0.0.5:7860", **headers: str) -> dict:
    raw = [(b"host", host.encode())] + [(k.lower().replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "method": method, "path": path, "headers": raw, "client": ("10.0.0.9", 5000)}


def test_revoking_the_last_key_does_not_open_a_non_loopback_server(tmp_path: Path) -> None:
    """A server on a non-loopback address started with keys; its last key is revoked while it runs (or the keys
    file is removed): it must not fall back to serving every client without authentication."""
    store = KeyStore(tmp_path)
    token, record = store.create("only", ["admin"])
    access = Access(Settings(host="0.0.0.0", data_dir=tmp_path), KeyStore(tmp_path))
    assert access.refusal(_scope("GET", "/api/galleries", authorization=f"Bearer {token}")) is None
    store.revoke(record.id)
    access.keys._checked = 0.0  # as after the reload interval
    for scope in (_scope("GET", "/api/galleries"), _scope("DELETE", "/api/galleries/g")):
        assert isinstance(access.refusal(scope), UnauthorizedError), scope["path"]
    (tmp_path / "api_keys.json").unlink()
    access.keys._checked = 0.0
    assert isinstance(access.refusal(_scope("POST", "/api/galleries")), UnauthorizedError)
    assert access.refusal(_scope("GET", "/healthz")) is None  # open routes stay open


def test_no_keys_on_a_non_loopback_address_refuses_api_routes(tmp_path: Path) -> None:
    """A process that never ran `check_bind` (a Ray Serve ingress replica) with no keys on 0.0.0.0: 401, not open;
    loopback without keys and --no-auth stay open, as documented."""
    keys = KeyStore(tmp_path)
    refused = Access(Settings(host="0.0.0.0", data_dir=tmp_path), keys).refusal(_scope("GET", "/api/galleries"))
    assert isinstance(refused, UnauthorizedError)
    loopback = Access(Settings(host="127.0.0.1", data_dir=tmp_path), keys)
    assert loopback.refusal(_scope("GET", "/api/galleries", host="127.0.0.1:7860")) is None
    no_auth = Access(Settings(host="0.0.0.0", data_dir=tmp_path, security={"no_auth": True}), keys)
    assert no_auth.refusal(_scope("GET", "/api/galleries")) is None


def test_more_than_one_host_header_is_refused(tmp_path: Path) -> None:
    """Two ``Host`` headers: the check must not pick one of them (a proxy may route by the other): 400."""
    keys = KeyStore(tmp_path)
    for host in ("127.0.0.1", "0.0.0.0"):  # whether or not Host values are checked at all
        access = Access(Settings(host=host, data_dir=tmp_path, security={"no_auth": True}), keys)
        scope = _scope("GET", "/healthz", host="127.0.0.1:7860")
        scope["headers"].append((b"host", b"evil.example"))
        refused = access.refusal(scope)
        assert isinstance(refused, HostNotAllowedError), host
        assert refused.status == 400 and refused.detail == {"host_headers": 2}
