"""Embedded SQLite gallery backend.

Durability and integrity:

* ``journal_mode=WAL`` (readers never block the writer; falls back with a warning only where the file
  system cannot do WAL), ``synchronous=FULL`` (the WAL is fsynced at every commit, so a write that
  returned survives a process crash *and* an OS crash / power loss), ``foreign_keys=ON`` (deleting a
  gallery or subject cascades to its embeddings), ``secure_delete=ON`` (freed content is overwritten
  with zeros). After a subject or gallery is deleted the WAL is checkpointed and truncated, so the
  erased biometric vectors are no longer in any file SQLite owns (what the file system or the disk
  keeps of old blocks is outside its reach).
* The schema version is ``PRAGMA user_version``; :data:`_MIGRATIONS` upgrades older files in one
  transaction and a file from a newer facegate is refused. ``PRAGMA application_id`` marks the file.
* Embeddings and templates are raw little-endian float32 BLOBs (``D * 4`` bytes).
* Every public call is one transaction; writes take ``BEGIN IMMEDIATE`` so a read-modify-write
  (appending embeddings and recomputing the template) is never interleaved with another writer.

Threading: **one connection guarded by a lock** (``check_same_thread=False``), not one connection per
thread. The hot path, 1:N search, is served from :class:`facegate.gallery.index.GalleryIndex` and never
touches SQLite, so parallel SQLite readers would buy nothing; a single serialised connection rules out
``SQLITE_BUSY`` lock-upgrade failures between our own threads, lets ``close()`` release everything
deterministically (thread-local connections of finished threads would leak), and guarantees no other
connection of ours holds a read snapshot when the post-delete ``wal_checkpoint(TRUNCATE)`` runs.
``busy_timeout`` still covers other processes opening the same file.

Every ``sqlite3`` exception is converted to a :class:`~facegate.errors.GalleryError` here.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from facegate.errors import (
    ErasureIncompleteError,
    GalleryError,
    GalleryExistsError,
    GalleryNotFoundError,
    SubjectNotFoundError,
)
from facegate.gallery.base import (
    Change,
    GalleryInfo,
    StoreSnapshot,
    SubjectInfo,
    decode_meta,
    encode_meta,
    quality_weighted_template,
    template_quality,
    validate_dim,
    validate_embeddings,
    validate_gallery_name,
    validate_import,
    validate_page,
    validate_subject_id,
)

log = logging.getLogger(__name__)

#: ``PRAGMA application_id`` of facegate gallery files (ASCII "FGGL").
APPLICATION_ID = 0x4647474C
#: Current schema version (``PRAGMA user_version``).
SCHEMA_VERSION = 2

#: ``version -> DDL statements`` that bring a file from ``version - 1`` to ``version``.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE galleries (
               id         INTEGER PRIMARY KEY,
               name       TEXT    NOT NULL UNIQUE,
               model      TEXT    NOT NULL,
               dim        INTEGER NOT NULL CHECK (dim > 0),
               created_at REAL    NOT NULL
           )""",
        """CREATE TABLE subjects (
               id               INTEGER PRIMARY KEY,
               gallery_id       INTEGER NOT NULL REFERENCES galleries(id) ON DELETE CASCADE,
               subject_id       TEXT    NOT NULL,
               meta             TEXT    NOT NULL DEFAULT '{}',
               template         BLOB    NOT NULL,
               template_quality REAL    NOT NULL,
               n_embeddings     INTEGER NOT NULL,
               created_at       REAL    NOT NULL,
               updated_at       REAL    NOT NULL,
               UNIQUE (gallery_id, subject_id)
           )""",
        """CREATE TABLE embeddings (
               id         INTEGER PRIMARY KEY,
               subject_pk INTEGER NOT NULL REFERENCES subjects(id) ON DELETE CASCADE,
               vector     BLOB    NOT NULL,
               quality    REAL    NOT NULL,
               created_at REAL    NOT NULL
           )""",
        "CREATE INDEX embeddings_by_subject ON embeddings(subject_pk)",
    ),
    2: (
        # the change feed: AUTOINCREMENT never reuses a number, and writers are serialised by
        # BEGIN IMMEDIATE, so sequence order is commit order
        """CREATE TABLE changes (
               seq          INTEGER PRIMARY KEY AUTOINCREMENT,
               op           TEXT    NOT NULL,
               gallery      TEXT    NOT NULL,
               subject_id   TEXT,
               committed_at REAL    NOT NULL
           )""",
    ),
}

#: Checkpoint attempts after a delete before it answers ErasureIncompleteError.
_CHECKPOINT_ATTEMPTS = 2
#: How often :meth:`SQLiteGalleryStore.wait_for_change` looks at the file (SQLite has no notifications).
_POLL_S = 0.005


def _convert(exc: sqlite3.Error, what: str) -> GalleryError:
    """A GalleryError carrying the sqlite3 error's class and SQLite error name."""
    name = getattr(exc, "sqlite_errorname", None)
    return GalleryError(
        f"gallery database error while {what}: {exc}",
        detail={"sqlite_error": type(exc).__name__, "sqlite_errorname": name},
    )


def _to_blob(vec: np.ndarray) -> bytes:
    """Raw little-endian float32 bytes of a vector."""
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()


def _from_blob(blob: bytes, dim: int) -> np.ndarray:
    """``(dim,) float32`` from a BLOB written by :func:`_to_blob`."""
    if len(blob) != 4 * dim:
        raise GalleryError(
            f"corrupt vector in the gallery database: {len(blob)} bytes, expected {4 * dim}",
            detail={"bytes": len(blob), "dim": dim},
        )
    return np.frombuffer(blob, dtype="<f4").astype(np.float32)


def _templates_of(rows: list[tuple[Any, bytes]], dim: int, gallery: str) -> tuple[list[str], np.ndarray]:
    """``(subject_ids, (S, D) float32)`` from ``(subject_id, template BLOB)`` rows."""
    ids = [str(r[0]) for r in rows]
    if not rows:
        return ids, np.zeros((0, dim), dtype=np.float32)
    blob = b"".join(r[1] for r in rows)
    if len(blob) != 4 * dim * len(rows):
        raise GalleryError(f"corrupt template in gallery {gallery!r}", detail={"gallery": gallery})
    return ids, np.frombuffer(blob, dtype="<f4").astype(np.float32).reshape(len(rows), dim)


class SQLiteGalleryStore:
    """:class:`~facegate.gallery.base.GalleryStore` on one SQLite file (see the module docstring).

    Args:
        path: database file (created, with mode 0600, if absent; parent folders too), or ``":memory:"``.
        busy_timeout_s: how long a write waits for another *process* holding the write lock.
        open_retry_s: how long opening retries (with backoff) while SQLite reports the file busy.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, busy_timeout_s: float = 5.0, open_retry_s: float = 60.0
    ) -> None:
        self._path = str(path)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        memory = self._path == ":memory:"
        if not memory:
            try:
                p = Path(self._path)
                p.parent.mkdir(parents=True, exist_ok=True)
                # Biometric data: owner-only. SQLite gives -wal/-shm files the database file's mode.
                os.close(os.open(p, os.O_CREAT | os.O_RDWR, 0o600))
            except OSError as exc:
                raise GalleryError(f"cannot open gallery database {self._path!r}: {exc}") from exc
        deadline = time.monotonic() + open_retry_s
        delay = 0.05
        while True:
            try:
                self._conn, mode = self._open(busy_timeout_s, memory)
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
        log.info("gallery database %s open (journal_mode=%s, schema v%d)", self._path, mode, SCHEMA_VERSION)

    def _open(self, busy_timeout_s: float, memory: bool) -> tuple[sqlite3.Connection, str]:
        """One attempt: connect, set the pragmas, migrate. Returns the connection and the journal mode."""
        try:
            conn = sqlite3.connect(self._path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise GalleryError(f"cannot open gallery database {self._path!r}: {exc}") from exc
        try:
            mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
            if mode != "wal" and not memory:
                log.warning("gallery %s: WAL unavailable on this file system, journal_mode=%s", self._path, mode)
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA secure_delete=ON")
            self._migrate(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise _convert(exc, f"opening {self._path!r}") from exc
        except BaseException:
            conn.close()
            raise
        return conn, mode

    # ------------------------------------------------------------------ plumbing
    @property
    def path(self) -> str:
        """The database file path as given."""
        return self._path

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            app_id = int(conn.execute("PRAGMA application_id").fetchone()[0])
            if app_id not in (0, APPLICATION_ID):
                raise GalleryError(f"{self._path!r} is not a facegate gallery (application_id={app_id:#x})")
            if version > SCHEMA_VERSION:
                raise GalleryError(
                    f"{self._path!r} has gallery schema v{version}; this facegate knows up to v{SCHEMA_VERSION}",
                    detail={"schema": version, "supported": SCHEMA_VERSION},
                )
            if version == 0:
                n_tables = conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
                if n_tables:
                    raise GalleryError(f"{self._path!r} is an SQLite file of something else, not a gallery")
                conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for stmt in _MIGRATIONS[target]:
                    conn.execute(stmt)
                log.info("gallery %s: migrated schema to v%d", self._path, target)
            if version != SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _tx(self, what: str, *, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction under the store lock; sqlite3 errors become GalleryError."""
        with self._lock:
            conn = self._conn
            if conn is None:
                raise GalleryError("the gallery store is closed")
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

    def data_version(self) -> int:
        """SQLite's ``PRAGMA data_version``: changes when another connection (e.g. another front-end
        process) commits to the file; never for this connection's own commits."""
        with self._lock:
            conn = self._conn
            if conn is None:
                raise GalleryError("the gallery store is closed")
            try:
                return int(conn.execute("PRAGMA data_version").fetchone()[0])
            except sqlite3.Error as exc:
                raise _convert(exc, "data_version") from exc

    def _checkpoint_truncate(self) -> None:
        """Copy the WAL into the database file and truncate it, so erased bytes leave every file SQLite owns.

        With ``secure_delete`` the deleted rows' space is zeroed in the new page versions; the checkpoint
        writes those over the old pages and empties the WAL that held earlier versions. It waits (busy
        timeout) for readers of older snapshots; if one still holds its snapshot after that, the delete
        stays committed and :class:`ErasureIncompleteError` says the bytes are not gone yet (the next
        delete, or :meth:`erase_pending`, finishes the job).
        """
        with self._lock:
            if self._conn is None or self.journal_mode != "wal":
                return
            busy = 1
            # a busy writer in another process can starve one attempt (each waits the busy timeout)
            for _ in range(_CHECKPOINT_ATTEMPTS):
                try:
                    busy, _, _ = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                except sqlite3.Error as exc:
                    raise _convert(exc, "erasing deleted data (WAL checkpoint)") from exc
                if not busy:
                    break
            if busy:
                raise ErasureIncompleteError(
                    "deleted, and no search returns it any more, but another connection holds a read snapshot, "
                    "so its bytes are still in the gallery's -wal file; retry to finish the erasure",
                    detail={"path": self._path},
                )

    def erase_pending(self) -> None:
        """Finish an erasure that :class:`ErasureIncompleteError` reported (checkpoint and truncate the WAL)."""
        self._checkpoint_truncate()

    @staticmethod
    def _log(conn: sqlite3.Connection, op: str, gallery: str, subject_id: str | None, now: float) -> None:
        """Append a change-log row inside the caller's write transaction."""
        conn.execute(
            "INSERT INTO changes (op, gallery, subject_id, committed_at) VALUES (?, ?, ?, ?)",
            (op, gallery, subject_id, now),
        )

    @staticmethod
    def _gallery_row(conn: sqlite3.Connection, name: str) -> tuple[int, str, int, float]:
        row = conn.execute("SELECT id, model, dim, created_at FROM galleries WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise GalleryNotFoundError(f"no gallery named {name!r}", detail={"gallery": name})
        return int(row[0]), str(row[1]), int(row[2]), float(row[3])

    @staticmethod
    def _subject_info(row: tuple[Any, ...]) -> SubjectInfo:
        sid, n, tq, meta, created, updated = row
        return SubjectInfo(
            subject_id=str(sid),
            n_embeddings=int(n),
            template_quality=float(tq),
            meta=decode_meta(meta),
            created_at=float(created),
            updated_at=float(updated),
        )

    _SUBJECT_COLS = "subject_id, n_embeddings, template_quality, meta, created_at, updated_at"

    # ------------------------------------------------------------------ galleries
    def create_gallery(self, name: str, model: str, dim: int) -> GalleryInfo:
        """Create an empty gallery; raises GalleryExistsError / InvalidParameterError."""
        validate_gallery_name(name)
        validate_gallery_name(model, what="model name")
        dim = validate_dim(dim)
        now = time.time()
        with self._tx(f"creating gallery {name!r}", write=True) as conn:
            if conn.execute("SELECT 1 FROM galleries WHERE name = ?", (name,)).fetchone():
                raise GalleryExistsError(f"gallery {name!r} already exists", detail={"gallery": name})
            conn.execute(
                "INSERT INTO galleries (name, model, dim, created_at) VALUES (?, ?, ?, ?)", (name, model, dim, now)
            )
            self._log(conn, "create_gallery", name, None, now)
        return GalleryInfo(name=name, model=model, dim=dim, created_at=now, subjects=0)

    def list_galleries(self) -> list[GalleryInfo]:
        """All galleries, ordered by name."""
        with self._tx("listing galleries", write=False) as conn:
            rows = conn.execute(
                "SELECT g.name, g.model, g.dim, g.created_at,"
                " (SELECT COUNT(*) FROM subjects s WHERE s.gallery_id = g.id)"
                " FROM galleries g ORDER BY g.name"
            ).fetchall()
        return [GalleryInfo(str(n), str(m), int(d), float(c), int(s)) for n, m, d, c, s in rows]

    def get_gallery(self, name: str) -> GalleryInfo:
        """One gallery; raises GalleryNotFoundError."""
        validate_gallery_name(name)
        with self._tx(f"reading gallery {name!r}", write=False) as conn:
            gid, model, dim, created = self._gallery_row(conn, name)
            n = conn.execute("SELECT COUNT(*) FROM subjects WHERE gallery_id = ?", (gid,)).fetchone()[0]
        return GalleryInfo(name=name, model=model, dim=dim, created_at=created, subjects=int(n))

    def delete_gallery(self, name: str) -> None:
        """Delete a gallery, its subjects and their embeddings; raises GalleryNotFoundError."""
        validate_gallery_name(name)
        with self._tx(f"deleting gallery {name!r}", write=True) as conn:
            gid = self._gallery_row(conn, name)[0]
            conn.execute("DELETE FROM galleries WHERE id = ?", (gid,))
            self._log(conn, "delete_gallery", name, None, time.time())
        self._checkpoint_truncate()

    # ------------------------------------------------------------------ subjects
    def add_embeddings(
        self,
        gallery: str,
        subject_id: str,
        embeddings: np.ndarray,
        qualities: np.ndarray,
        meta: dict[str, Any] | None = None,
    ) -> SubjectInfo:
        """Append ``(k, D) float32`` unit-norm embeddings with ``(k,)`` qualities; recompute the template.

        ``meta`` replaces the stored meta when not ``None``. One ``BEGIN IMMEDIATE`` transaction.
        """
        validate_gallery_name(gallery)
        validate_subject_id(subject_id)
        meta_text = encode_meta(meta)
        with self._tx(f"enrolling {subject_id!r} in {gallery!r}", write=True) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            emb, q = validate_embeddings(embeddings, qualities, dim)
            now = time.time()
            row = conn.execute(
                "SELECT id FROM subjects WHERE gallery_id = ? AND subject_id = ?", (gid, subject_id)
            ).fetchone()
            if row is None:
                cur = conn.execute(
                    "INSERT INTO subjects (gallery_id, subject_id, meta, template, template_quality,"
                    " n_embeddings, created_at, updated_at) VALUES (?, ?, ?, x'', 0, 0, ?, ?)",
                    (gid, subject_id, meta_text or "{}", now, now),
                )
                spk = int(cur.lastrowid)  # type: ignore[arg-type]
            else:
                spk = int(row[0])
                if meta_text is not None:
                    conn.execute("UPDATE subjects SET meta = ? WHERE id = ?", (meta_text, spk))
            conn.executemany(
                "INSERT INTO embeddings (subject_pk, vector, quality, created_at) VALUES (?, ?, ?, ?)",
                [(spk, _to_blob(e), float(qi), now) for e, qi in zip(emb, q, strict=True)],
            )
            stored = conn.execute(
                "SELECT vector, quality FROM embeddings WHERE subject_pk = ? ORDER BY id", (spk,)
            ).fetchall()
            all_e = np.stack([_from_blob(v, dim) for v, _ in stored])
            all_q = np.asarray([qq for _, qq in stored], dtype=np.float32)
            template = quality_weighted_template(all_e, all_q)
            conn.execute(
                "UPDATE subjects SET template = ?, template_quality = ?, n_embeddings = ?, updated_at = ? WHERE id = ?",
                (_to_blob(template), template_quality(all_q), len(stored), now, spk),
            )
            self._log(conn, "enrol", gallery, subject_id, now)
            out = conn.execute(f"SELECT {self._SUBJECT_COLS} FROM subjects WHERE id = ?", (spk,)).fetchone()
        return self._subject_info(out)

    def get_subject(self, gallery: str, subject_id: str) -> SubjectInfo:
        """One subject; raises GalleryNotFoundError / SubjectNotFoundError."""
        validate_gallery_name(gallery)
        validate_subject_id(subject_id)
        with self._tx(f"reading {subject_id!r} in {gallery!r}", write=False) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            row = conn.execute(
                f"SELECT {self._SUBJECT_COLS} FROM subjects WHERE gallery_id = ? AND subject_id = ?",
                (gid, subject_id),
            ).fetchone()
        if row is None:
            raise SubjectNotFoundError(
                f"no subject {subject_id!r} in gallery {gallery!r}",
                detail={"gallery": gallery, "subject_id": subject_id},
            )
        return self._subject_info(row)

    def get_template(self, gallery: str, subject_id: str) -> np.ndarray:
        """A subject's stored ``(D,) float32`` template."""
        validate_gallery_name(gallery)
        validate_subject_id(subject_id)
        with self._tx(f"reading template of {subject_id!r}", write=False) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            row = conn.execute(
                "SELECT template FROM subjects WHERE gallery_id = ? AND subject_id = ?", (gid, subject_id)
            ).fetchone()
        if row is None:
            raise SubjectNotFoundError(
                f"no subject {subject_id!r} in gallery {gallery!r}",
                detail={"gallery": gallery, "subject_id": subject_id},
            )
        return _from_blob(row[0], dim)

    def list_subjects(self, gallery: str, offset: int = 0, limit: int = 100) -> list[SubjectInfo]:
        """A page of subjects ordered by ``subject_id``."""
        validate_gallery_name(gallery)
        offset, limit = validate_page(offset, limit)
        with self._tx(f"listing subjects of {gallery!r}", write=False) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            rows = conn.execute(
                f"SELECT {self._SUBJECT_COLS} FROM subjects WHERE gallery_id = ? ORDER BY subject_id LIMIT ? OFFSET ?",
                (gid, limit, offset),
            ).fetchall()
        return [self._subject_info(r) for r in rows]

    def delete_subject(self, gallery: str, subject_id: str) -> None:
        """Erase a subject and (by cascade) all its embedding rows; then truncate the WAL."""
        validate_gallery_name(gallery)
        validate_subject_id(subject_id)
        with self._tx(f"deleting {subject_id!r} from {gallery!r}", write=True) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            cur = conn.execute("DELETE FROM subjects WHERE gallery_id = ? AND subject_id = ?", (gid, subject_id))
            if cur.rowcount == 0:
                raise SubjectNotFoundError(
                    f"no subject {subject_id!r} in gallery {gallery!r}",
                    detail={"gallery": gallery, "subject_id": subject_id},
                )
            self._log(conn, "delete_subject", gallery, subject_id, time.time())
        self._checkpoint_truncate()

    def load_templates(self, gallery: str) -> tuple[list[str], np.ndarray]:
        """``(subject_ids, (S, D) float32 templates)`` of a gallery, ordered by ``subject_id``."""
        validate_gallery_name(gallery)
        with self._tx(f"loading templates of {gallery!r}", write=False) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            rows = conn.execute(
                "SELECT subject_id, template FROM subjects WHERE gallery_id = ? ORDER BY subject_id", (gid,)
            ).fetchall()
        return _templates_of(rows, dim, gallery)

    def import_templates(
        self, gallery: str, subject_ids: list[str], templates: np.ndarray, qualities: np.ndarray
    ) -> int:
        """Bulk-write ``(S, D) float32`` unit-norm templates as single-embedding subjects (one transaction)."""
        validate_gallery_name(gallery)
        ids = validate_import(subject_ids, templates, qualities)
        with self._tx(f"importing {len(ids)} templates into {gallery!r}", write=True) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            emb, q = validate_embeddings(templates, qualities, dim)
            now = time.time()
            # a re-imported subject starts over from the imported template
            conn.executemany(
                "DELETE FROM subjects WHERE gallery_id = ? AND subject_id = ?", [(gid, sid) for sid in ids]
            )
            blobs = [_to_blob(e) for e in emb]
            before = int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM subjects").fetchone()[0])
            conn.executemany(
                "INSERT INTO subjects (gallery_id, subject_id, meta, template, template_quality,"
                " n_embeddings, created_at, updated_at) VALUES (?, ?, '{}', ?, ?, 1, ?, ?)",
                [(gid, sid, b, float(qi), now, now) for sid, b, qi in zip(ids, blobs, q, strict=True)],
            )
            conn.execute(
                "INSERT INTO embeddings (subject_pk, vector, quality, created_at)"
                " SELECT id, template, template_quality, created_at FROM subjects WHERE id > ?",
                (before,),
            )
            conn.executemany(
                "INSERT INTO changes (op, gallery, subject_id, committed_at) VALUES ('enrol', ?, ?, ?)",
                [(gallery, sid, now) for sid in ids],
            )
        return len(ids)

    # ------------------------------------------------------------------ change feed
    def current_seq(self) -> int:
        """The last committed change's sequence number (0 when none)."""
        with self._tx("reading the change sequence", write=False) as conn:
            return int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])

    def changes_since(self, seq: int, limit: int = 10_000) -> list[Change]:
        """Up to ``limit`` changes after ``seq`` with the current state they refer to (one snapshot)."""
        with self._tx("reading the change feed", write=False) as conn:
            rows = conn.execute(
                "SELECT c.seq, c.op, c.gallery, c.subject_id, c.committed_at, g.dim, s.template"
                " FROM changes c LEFT JOIN galleries g ON g.name = c.gallery"
                " LEFT JOIN subjects s ON s.gallery_id = g.id AND s.subject_id = c.subject_id"
                " WHERE c.seq > ? ORDER BY c.seq LIMIT ?",
                (int(seq), int(limit)),
            ).fetchall()
        out = []
        for sq, op, gal, sid, at, dim, blob in rows:
            tpl = _from_blob(blob, int(dim)) if blob is not None and dim is not None else None
            out.append(Change(int(sq), str(op), str(gal), sid, float(at), None if dim is None else int(dim), tpl))
        return out

    def load_snapshot(self) -> StoreSnapshot:
        """Every gallery's templates and the sequence number they are current at (one read transaction)."""
        galleries: dict[str, tuple[int, list[str], np.ndarray]] = {}
        with self._tx("loading every gallery", write=False) as conn:
            seq = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])
            for gid, name, dim in conn.execute("SELECT id, name, dim FROM galleries ORDER BY name").fetchall():
                rows = conn.execute(
                    "SELECT subject_id, template FROM subjects WHERE gallery_id = ? ORDER BY subject_id", (gid,)
                ).fetchall()
                galleries[str(name)] = (int(dim), *_templates_of(rows, int(dim), str(name)))
        return StoreSnapshot(seq=seq, galleries=galleries)

    def wait_for_change(self, after: int, timeout_s: float) -> bool:
        """Poll the change sequence every few milliseconds, up to ``timeout_s``; whether it moved past ``after``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            if self.current_seq() > after:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(_POLL_S, left))

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Checkpoint and close the connection; later calls raise GalleryError. Idempotent."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            try:
                conn.close()
            except sqlite3.Error as exc:
                raise _convert(exc, "closing") from exc

    def __enter__(self) -> SQLiteGalleryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SQLiteGalleryStore({self._path!r})"


__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "SQLiteGalleryStore"]
