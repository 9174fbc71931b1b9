"""Embedded SQLite gallery backend: one file, one host.

WAL, ``synchronous=FULL`` (an answered write survives a power loss), ``secure_delete=ON`` and a WAL checkpoint
after each delete, so erased vectors leave every file SQLite owns. Writers of every process queue on ``flock`` of
``<file>-writers``. One connection behind a lock: search never reads SQLite (the index serves it), and no other
connection of ours holds a read snapshot when the post-delete checkpoint runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from facegate.errors import ErasureIncompleteError, GalleryError, GalleryUnavailableError
from facegate.gallery.base import RECOUNT, GalleryStore, schema

log = logging.getLogger(__name__)

APPLICATION_ID = 0x4647474C  # PRAGMA application_id of facegate gallery files (ASCII "FGGL")
SCHEMA_VERSION = 3

_TABLES = schema("INTEGER PRIMARY KEY", "INTEGER", "BLOB", "REAL", "INTEGER PRIMARY KEY AUTOINCREMENT")
#: ``version -> statements`` that bring an older file from ``version - 1`` to ``version`` (a new one gets _TABLES).
_MIGRATIONS = {2: _TABLES[-1:], 3: ("ALTER TABLE galleries ADD COLUMN subjects INTEGER NOT NULL DEFAULT 0", RECOUNT)}

_CHECKPOINT_ATTEMPTS = 2  # after a delete, before it answers ErasureIncompleteError
BUSY_TIMEOUT_S = 5.0  # how long a write waits for another process's write lock


def _convert(exc: sqlite3.Error, what: str) -> GalleryError:
    return GalleryError(
        f"gallery database error while {what}: {exc}",
        detail={"sqlite_error": type(exc).__name__, "sqlite_errorname": getattr(exc, "sqlite_errorname", None)},
    )


class SQLiteGalleryStore(GalleryStore):
    """The store on one SQLite file ``path`` (created with mode 0600, parents too), or ``":memory:"``;
    ``open_retry_s``: how long opening retries while SQLite reports the file busy."""

    def __init__(self, path: str | os.PathLike[str], *, open_retry_s: float = 60.0) -> None:
        self._path = str(path)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._writers_fd = -1
        memory = self._path == ":memory:"
        if not memory:
            try:
                Path(self._path).parent.mkdir(parents=True, exist_ok=True)
                # Biometric data: owner-only. SQLite gives -wal/-shm files the database file's mode. Only a new
                # file is opened here: closing a descriptor of an open database drops this process's POSIX locks on
                # it, and another process would then take itself for the last user and delete the live WAL.
                with contextlib.suppress(FileExistsError):
                    os.close(os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            except OSError as exc:
                raise GalleryError(f"cannot open gallery database {self._path!r}: {exc}") from exc
        deadline = time.monotonic() + open_retry_s
        delay = 0.05
        while True:
            try:
                self._conn, mode = self._open(memory)
                break
            except GalleryError as exc:
                # SQLITE_BUSY while opening: another process holds a lock SQLite would not wait for (the busy
                # handler is skipped where waiting could deadlock), e.g. while a front-end restarts under load
                busy = exc.detail.get("sqlite_errorname") in ("SQLITE_BUSY", "SQLITE_BUSY_RECOVERY", "SQLITE_LOCKED")
                if not busy or time.monotonic() + delay > deadline:
                    raise
                log.warning("gallery %s is busy while opening; retrying in %.2f s", self._path, delay)
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
        self.journal_mode = mode
        if not memory:  # opened last: a failed open (retried while the file is busy) leaks no descriptor
            try:
                self._writers_fd = os.open(f"{self._path}-writers", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                self.close()
                raise GalleryError(f"cannot open {self._path!r}-writers: {exc}") from exc
        log.info("gallery database %s open (journal_mode=%s, schema v%d)", self._path, mode, SCHEMA_VERSION)

    def _open(self, memory: bool) -> tuple[sqlite3.Connection, str]:
        try:
            conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise GalleryError(f"cannot open gallery database {self._path!r}: {exc}") from exc
        try:
            mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
            if mode != "wal" and not memory:
                log.warning("gallery %s: WAL unavailable on this file system, journal_mode=%s", self._path, mode)
            conn.executescript("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON; PRAGMA secure_delete=ON")
            self._migrate(conn)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, sqlite3.Error):
                raise _convert(exc, f"opening {self._path!r}") from exc
            raise
        return conn, mode

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")  # on any error :meth:`_open` closes the connection, which rolls it back
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        app_id = int(conn.execute("PRAGMA application_id").fetchone()[0])
        if app_id not in (0, APPLICATION_ID):
            raise GalleryError(f"{self._path!r} is not a facegate gallery (application_id={app_id:#x})")
        if version > SCHEMA_VERSION:
            raise self._newer_schema(repr(self._path), version, SCHEMA_VERSION)
        if version == 0:
            if conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]:
                raise GalleryError(f"{self._path!r} is an SQLite file of something else, not a gallery")
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            for stmt in _TABLES:
                conn.execute(stmt)
        for target in range((version or SCHEMA_VERSION) + 1, SCHEMA_VERSION + 1):
            for stmt in _MIGRATIONS[target]:
                conn.execute(stmt)
            log.info("gallery %s: migrated schema to v%d", self._path, target)
        if version != SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")

    @contextmanager
    def _tx(self, what: str, *, write: bool, snapshot: bool = False) -> Iterator[sqlite3.Connection]:
        # ``snapshot`` needs nothing: every SQLite transaction reads one snapshot of the file
        with self._lock:
            if (conn := self._conn) is None:
                raise GalleryError("the gallery store is closed")
            with self._writers(what) if write else contextlib.nullcontext():
                try:
                    conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                    yield conn
                    conn.execute("COMMIT")
                except BaseException as exc:
                    if conn.in_transaction:
                        try:
                            conn.execute("ROLLBACK")
                        except sqlite3.Error:
                            log.exception("gallery %s: ROLLBACK failed", self._path)
                    if isinstance(exc, sqlite3.Error):
                        raise _convert(exc, what) from exc
                    raise

    @contextmanager
    def _writers(self, what: str) -> Iterator[None]:
        """Hold ``flock`` on ``<file>-writers`` (none for ``:memory:``). SQLite's busy handler sleeps up to
        100 ms between attempts, so several processes' writers leave the lock idle and one can starve past the
        busy timeout; here a waiter retries within a millisecond. GalleryUnavailableError (503) past
        :data:`BUSY_TIMEOUT_S`."""
        if self._writers_fd < 0:
            yield
            return
        deadline, delay = time.monotonic() + BUSY_TIMEOUT_S, 5e-5
        while True:
            try:
                fcntl.flock(self._writers_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise GalleryUnavailableError(
                        f"the gallery database stayed busy for {BUSY_TIMEOUT_S:g} s while {what}; retry",
                        detail={"sqlite_errorname": "SQLITE_BUSY"},
                    ) from None
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)
        try:
            yield
        finally:
            fcntl.flock(self._writers_fd, fcntl.LOCK_UN)

    def _erase_deleted(self) -> None:
        """Copy the WAL (with ``secure_delete``'s zeroed pages) into the file and truncate it. A reader of an
        older snapshot that outlasts the busy timeout leaves the delete committed but the bytes in the WAL:
        :class:`ErasureIncompleteError`. The next delete (a retry of the same one too, which then answers not found)
        or :meth:`erase_pending` finishes the job."""
        with self._lock:
            if self._conn is None or self.journal_mode != "wal":
                return
            # a busy writer in another process can starve one attempt (each waits the busy timeout)
            for _ in range(_CHECKPOINT_ATTEMPTS):
                try:
                    with self._writers("erasing deleted data"):  # the checkpoint needs the write lock
                        busy, _, _ = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                except sqlite3.Error as exc:
                    raise _convert(exc, "erasing deleted data (WAL checkpoint)") from exc
                if not busy:
                    break
            else:
                raise ErasureIncompleteError(
                    "deleted, and no search returns it any more, but another connection holds a read snapshot, "
                    "so its bytes are still in the gallery's -wal file; retry to finish the erasure",
                    detail={"path": self._path},
                )

    erase_pending = _erase_deleted

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            if self._writers_fd >= 0:
                os.close(self._writers_fd)
            try:
                conn.close()
            except sqlite3.Error as exc:
                raise _convert(exc, "closing") from exc
