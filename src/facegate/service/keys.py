"""API keys with scopes, stored hashed in the data folder (docs/security.md: the key format, scopes and file).

Only the SHA-256 of a key is stored: its 256 random bits leave nothing for a slow hash to protect. The file is
checked every :data:`RELOAD_INTERVAL_S` and re-read when it changed, so keys created or revoked with the CLI apply
to a running server."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from facegate.errors import InvalidParameterError, KeysFileError

log = logging.getLogger(__name__)

Scope = Literal["read", "enrol", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "enrol", "admin")
KEYS_FILE = "api_keys.json"
RELOAD_INTERVAL_S = 1.0  # seconds between checks of the keys file for another process's changes
_PREFIX = "fg_"


@dataclass(frozen=True)
class ApiKey:
    """One stored key (never the secret): ``sha256`` is the digest of the whole key, ``created`` Unix time."""

    id: str
    name: str
    scopes: tuple[Scope, ...]
    sha256: str
    created: float

    def allows(self, scope: Scope) -> bool:
        """Whether this key grants ``scope`` (``admin`` grants every scope)."""
        return scope in self.scopes or "admin" in self.scopes

    def public(self) -> dict[str, Any]:
        """The listing form: everything but the digest."""
        return {k: v for k, v in asdict(self).items() if k != "sha256"}


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def parse_scopes(scopes: Iterable[str]) -> tuple[Scope, ...]:
    """Validated, de-duplicated scopes in canonical order (InvalidParameterError: an unknown scope, or none)."""
    given = {s.strip() for s in scopes if s.strip()}
    unknown = given - set(SCOPES)
    if unknown or not given:
        raise InvalidParameterError(
            f"scopes must be a non-empty subset of {', '.join(SCOPES)}; got {sorted(given)}",
            detail={"field": "scopes", "allowed": list(SCOPES)},
        )
    return tuple(s for s in SCOPES if s in given)


class KeyStore:
    """The keys file at ``path``, or ``<data_dir>/api_keys.json``; thread-safe."""

    def __init__(self, data_dir: Path, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else Path(data_dir) / KEYS_FILE
        self._lock = threading.Lock()
        self._by_digest: dict[str, ApiKey] = {}
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime, size) of the file the keys were read from
        self._checked = 0.0
        self._load()

    def _load(self) -> None:
        """Read the file unless it is the one read last (every write replaces it: a new inode), so a request's
        check costs a ``stat`` a second, not a parse of every key."""
        try:
            st = self.path.stat()
        except (FileNotFoundError, NotADirectoryError):  # no keys file (or no folder for it)
            self._by_digest, self._seen = {}, None
            return
        if (st.st_ino, st.st_mtime_ns, st.st_size) == self._seen:
            return
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            self._by_digest = {
                k["sha256"]: ApiKey(k["id"], k["name"], parse_scopes(k["scopes"]), k["sha256"], float(k["created"]))
                for k in raw.get("keys", [])
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidParameterError) as exc:
            raise KeysFileError(f"broken API keys file {self.path}: {exc}", detail={"path": str(self.path)}) from exc
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_INTERVAL_S:
            return
        with self._lock:
            self._checked = now
            try:
                self._load()
            except (OSError, KeysFileError):
                log.exception("cannot read the API keys file; keeping the keys read before")

    def list_keys(self) -> list[ApiKey]:
        """Every key, oldest first."""
        self._refresh()
        return sorted(self._by_digest.values(), key=lambda k: (k.created, k.id))

    def __len__(self) -> int:
        self._refresh()
        return len(self._by_digest)

    def verify(self, token: str) -> ApiKey | None:
        """The key ``token`` is, or ``None`` (unknown, revoked, malformed)."""
        if not token.startswith(_PREFIX) or len(token) > 128:
            return None
        self._refresh()
        return self._by_digest.get(_digest(token))  # by a hash of a 256-bit secret: its timing reveals nothing

    def _write(self, keys: list[ApiKey]) -> None:
        body = json.dumps({"keys": [asdict(k) for k in keys]}, indent=2)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".api_keys.", dir=self.path.parent)  # created with mode 0600
        except OSError as exc:
            msg = f"cannot write the API keys file in {self.path.parent}: {exc.strerror}"
            raise InvalidParameterError(msg, detail={"field": "data_dir", "path": str(self.path.parent)}) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)  # atomic: a server never reads half a file
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._lock:
            self._by_digest = {k.sha256: k for k in keys}

    def _current(self) -> list[ApiKey]:
        with self._lock:
            self._load()
            return list(self._by_digest.values())

    def create(self, name: str, scopes: Iterable[str]) -> tuple[str, ApiKey]:
        """A new key: ``(the key, shown once; its stored record)``."""
        parsed = parse_scopes(scopes)
        existing = self._current()
        while (key_id := secrets.token_hex(4)) in {k.id for k in existing}:
            pass
        token = f"{_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        record = ApiKey(key_id, name, parsed, _digest(token), time.time())
        self._write([*existing, record])
        return token, record

    def revoke(self, key_id: str) -> ApiKey:
        """Remove the key with this id (InvalidParameterError: no key has it)."""
        existing = self._current()
        if not (match := [k for k in existing if k.id == key_id]):
            raise InvalidParameterError(f"no API key with id {key_id!r}", detail={"field": "id"})
        self._write([k for k in existing if k.id != key_id])
        return match[0]
