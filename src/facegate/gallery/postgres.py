"""PostgreSQL gallery backend (psycopg 3 with a psycopg_pool connection pool).

Several engines, on one host or many, share one database: each keeps its index current from the change
feed, woken by ``LISTEN``/``NOTIFY`` on channel :data:`CHANNEL` (the notification is sent inside the
writing transaction, so PostgreSQL delivers it only once the change is visible).

Sequence numbers: a ``SERIAL`` would hand out numbers in *allocation* order, and a transaction holding a
lower number could commit after one holding a higher number, so a follower that read up to the higher
one would skip the lower one for ever. Every write transaction therefore takes one transaction-level
advisory lock (:data:`WRITE_LOCK`) first and numbers its change rows ``max(seq) + 1``: writes are
serialised, sequence order is commit order and the log has no gaps. Writes are a few milliseconds, and
bulk imports write many subjects per transaction, so one writer at a time is not the bottleneck.

Reads of the feed (``changes_since``, ``load_snapshot``) run in ``REPEATABLE READ`` so the change rows
and the subject rows they join come from one snapshot.

Erasure: ``DELETE`` removes the row from every later snapshot at once, but the old tuple stays in the
table's heap pages (and in the WAL segments and any base backup) until ``VACUUM`` reclaims the space and a
later write overwrites it; see ``docs/gallery.md``. :meth:`PostgresGalleryStore.delete_subject` runs a
``VACUUM`` of the three tables after the delete so the dead tuples are pruned before it answers, as far as
no older snapshot (a long-running transaction anywhere on the server) still needs them.

Every psycopg exception becomes a :class:`~facegate.errors.GalleryError`; a server that cannot be reached
becomes :class:`~facegate.errors.GalleryUnavailableError` (HTTP 503). The calls whose logic every SQL
backend shares live in :class:`facegate.gallery.sqlstore.SQLGalleryStore`; this module holds the PostgreSQL
SQL, transactions, change numbering and erasure.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from facegate.errors import GalleryError, GalleryUnavailableError
from facegate.gallery.base import SUBJECT_COLS, pack_vector, read_templates
from facegate.gallery.sqlstore import ChangeRow, SQLGalleryStore

log = logging.getLogger(__name__)

#: NOTIFY channel the writers signal on.
CHANNEL = "facegate_gallery"
#: Key of the advisory lock that serialises writers (ASCII "FGGL").
WRITE_LOCK = 0x4647474C
#: Schema version kept in ``facegate_schema``.
SCHEMA_VERSION = 1

_DDL = (
    "CREATE TABLE IF NOT EXISTS facegate_schema (version INTEGER NOT NULL)",
    """CREATE TABLE IF NOT EXISTS galleries (
           id         BIGSERIAL PRIMARY KEY,
           name       TEXT    NOT NULL UNIQUE,
           model      TEXT    NOT NULL,
           dim        INTEGER NOT NULL CHECK (dim > 0),
           created_at DOUBLE PRECISION NOT NULL
       )""",
    """CREATE TABLE IF NOT EXISTS subjects (
           id               BIGSERIAL PRIMARY KEY,
           gallery_id       BIGINT  NOT NULL REFERENCES galleries(id) ON DELETE CASCADE,
           subject_id       TEXT    NOT NULL,
           meta             TEXT    NOT NULL DEFAULT '{}',
           template         BYTEA   NOT NULL,
           template_quality REAL    NOT NULL,
           n_embeddings     INTEGER NOT NULL,
           created_at       DOUBLE PRECISION NOT NULL,
           updated_at       DOUBLE PRECISION NOT NULL,
           UNIQUE (gallery_id, subject_id)
       )""",
    """CREATE TABLE IF NOT EXISTS embeddings (
           id         BIGSERIAL PRIMARY KEY,
           subject_pk BIGINT NOT NULL REFERENCES subjects(id) ON DELETE CASCADE,
           vector     BYTEA  NOT NULL,
           quality    REAL   NOT NULL,
           created_at DOUBLE PRECISION NOT NULL
       )""",
    "CREATE INDEX IF NOT EXISTS embeddings_by_subject ON embeddings(subject_pk)",
    """CREATE TABLE IF NOT EXISTS changes (
           seq          BIGINT PRIMARY KEY,
           op           TEXT   NOT NULL,
           gallery      TEXT   NOT NULL,
           subject_id   TEXT,
           committed_at DOUBLE PRECISION NOT NULL
       )""",
)


class PostgresGalleryStore(SQLGalleryStore):
    """:class:`~facegate.gallery.base.GalleryStore` on a PostgreSQL database (see the module docstring).

    Args:
        url: a libpq connection URL, ``postgresql://user@host:port/db``.
        pool_size: most connections this process opens.
        connect_timeout_s: how long start-up and each call wait for a connection before answering
            :class:`~facegate.errors.GalleryUnavailableError`.
    """

    def __init__(self, url: str, *, pool_size: int = 4, connect_timeout_s: float = 5.0) -> None:
        import psycopg
        from psycopg_pool import ConnectionPool, PoolTimeout

        self._psycopg = psycopg
        self._pool_timeout = PoolTimeout
        self._url = url
        self._timeout = connect_timeout_s
        self._listen: Any = None
        self._listen_lock = threading.Lock()
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max(1, pool_size),
            timeout=connect_timeout_s,
            kwargs={"connect_timeout": max(1, int(connect_timeout_s))},
            open=False,
            name="facegate-gallery",
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except PoolTimeout as exc:
            self._pool.close()
            raise GalleryUnavailableError(
                f"cannot reach the gallery database within {connect_timeout_s:g} s", detail={"backend": "postgresql"}
            ) from exc
        try:
            self._migrate()
        except BaseException:
            self._pool.close()
            raise
        log.info("gallery database %s open (PostgreSQL, schema v%d)", self.redacted_url, SCHEMA_VERSION)

    @property
    def redacted_url(self) -> str:
        """The URL without its password (for logs)."""
        from psycopg.conninfo import conninfo_to_dict

        try:
            d = conninfo_to_dict(self._url)
        except self._psycopg.Error:
            return "postgresql://?"
        return f"postgresql://{d.get('user', '')}@{d.get('host', '')}:{d.get('port', '')}/{d.get('dbname', '')}"

    # ------------------------------------------------------------------ plumbing
    def _convert(self, exc: Exception, what: str) -> GalleryError:
        unavailable = isinstance(exc, self._pool_timeout | self._psycopg.OperationalError)
        cls = GalleryUnavailableError if unavailable else GalleryError
        return cls(
            f"gallery database error while {what}: {exc}".strip(),
            detail={"backend": "postgresql", "error": type(exc).__name__},
        )

    @contextmanager
    def _tx(self, what: str, *, write: bool, snapshot: bool = False) -> Iterator[Any]:
        """One transaction on a pooled connection; psycopg errors become GalleryError."""
        if self._pool.closed:
            raise GalleryError("the gallery store is closed")
        try:
            with self._pool.connection() as conn, conn.transaction():
                if snapshot:
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                if write:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
                yield conn
        except (self._psycopg.Error, self._pool_timeout) as exc:
            raise self._convert(exc, what) from exc

    def _migrate(self) -> None:
        with self._tx("creating the schema", write=True) as conn:
            for stmt in _DDL:
                conn.execute(stmt)
            row = conn.execute("SELECT version FROM facegate_schema").fetchone()
            if row is None:
                conn.execute("INSERT INTO facegate_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
            elif int(row[0]) > SCHEMA_VERSION:
                raise GalleryError(
                    f"the gallery database has schema v{row[0]}; this facegate knows up to v{SCHEMA_VERSION}",
                    detail={"schema": int(row[0]), "supported": SCHEMA_VERSION},
                )

    def _log(self, conn: Any, rows: list[ChangeRow], now: float) -> None:
        """Append change rows ``(op, gallery, subject_id)`` numbered after the current maximum (the caller
        holds :data:`WRITE_LOCK`), and notify the followers (delivered at commit)."""
        base = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO changes (seq, op, gallery, subject_id, committed_at) VALUES (%s, %s, %s, %s, %s)",
                [(base + i + 1, op, g, s, now) for i, (op, g, s) in enumerate(rows)],
            )
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(base + len(rows))))

    # ------------------------------------------------------------------ SQL of the shared calls
    _SQL_GALLERY_EXISTS = "SELECT 1 FROM galleries WHERE name = %s"
    _SQL_INSERT_GALLERY = "INSERT INTO galleries (name, model, dim, created_at) VALUES (%s, %s, %s, %s)"
    _SQL_GALLERY_ROW = "SELECT id, model, dim, created_at FROM galleries WHERE name = %s"
    _SQL_LIST_GALLERIES = (
        "SELECT g.name, g.model, g.dim, g.created_at,"
        " (SELECT COUNT(*) FROM subjects s WHERE s.gallery_id = g.id)"
        " FROM galleries g ORDER BY g.name"
    )
    _SQL_GALLERY_IDS = "SELECT id, name, dim FROM galleries ORDER BY name"
    _SQL_COUNT_SUBJECTS = "SELECT COUNT(*) FROM subjects WHERE gallery_id = %s"
    _SQL_DELETE_GALLERY = "DELETE FROM galleries WHERE id = %s"
    _SQL_SUBJECT_PK = "SELECT id FROM subjects WHERE gallery_id = %s AND subject_id = %s"
    _SQL_SET_META = "UPDATE subjects SET meta = %s WHERE id = %s"
    _SQL_STORED_EMBEDDINGS = "SELECT vector, quality FROM embeddings WHERE subject_pk = %s ORDER BY id"
    _SQL_SET_TEMPLATE = (
        "UPDATE subjects SET template = %s, template_quality = %s, n_embeddings = %s, updated_at = %s WHERE id = %s"
    )
    _SQL_SUBJECT_BY_PK = f"SELECT {SUBJECT_COLS} FROM subjects WHERE id = %s"
    _SQL_SUBJECT = f"SELECT {SUBJECT_COLS} FROM subjects WHERE gallery_id = %s AND subject_id = %s"
    _SQL_TEMPLATE = "SELECT template FROM subjects WHERE gallery_id = %s AND subject_id = %s"
    # byte order, as SQLite's default BINARY collation, whatever the database's locale
    _SQL_SUBJECT_PAGE = (
        f'SELECT {SUBJECT_COLS} FROM subjects WHERE gallery_id = %s ORDER BY subject_id COLLATE "C" LIMIT %s OFFSET %s'
    )
    _SQL_DELETE_SUBJECT = "DELETE FROM subjects WHERE gallery_id = %s AND subject_id = %s"
    _SQL_CURRENT_SEQ = "SELECT COALESCE(MAX(seq), 0) FROM changes"
    _SQL_CHANGES = (
        "SELECT c.seq, c.op, c.gallery, c.subject_id, c.committed_at, g.dim, s.template"
        " FROM changes c LEFT JOIN galleries g ON g.name = c.gallery"
        " LEFT JOIN subjects s ON s.gallery_id = g.id AND s.subject_id = c.subject_id"
        " WHERE c.seq > %s ORDER BY c.seq LIMIT %s"
    )

    def _insert_subject(self, conn: Any, gid: int, subject_id: str, meta_text: str, now: float) -> int:
        return int(
            conn.execute(
                "INSERT INTO subjects (gallery_id, subject_id, meta, template, template_quality,"
                " n_embeddings, created_at, updated_at) VALUES (%s, %s, %s, '', 0, 0, %s, %s) RETURNING id",
                (gid, subject_id, meta_text, now, now),
            ).fetchone()[0]
        )

    def _insert_embeddings(self, conn: Any, rows: list[tuple[int, bytes, float, float]]) -> None:
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO embeddings (subject_pk, vector, quality, created_at) VALUES (%s, %s, %s, %s)", rows
            )

    def _templates(
        self, conn: Any, gid: int, dim: int, gallery: str, ordered: bool = True
    ) -> tuple[list[str], np.ndarray]:
        # one server-side cursor, bytea in binary; the start-up load skips the sort (a 1M-row sort spills to disk)
        order = ' ORDER BY subject_id COLLATE "C"' if ordered else ""
        with conn.cursor(name="facegate_templates", binary=True) as cur:
            cur.execute(f"SELECT subject_id, template FROM subjects WHERE gallery_id = %s{order}", (gid,))
            return read_templates(cur, dim, gallery)

    def _erase_deleted(self) -> None:
        self._vacuum()

    def _vacuum(self) -> None:
        """Prune the dead tuples a delete left (best effort: an older snapshot elsewhere can keep them)."""
        try:
            with self._pool.connection() as conn:
                conn.autocommit = True
                try:
                    conn.execute("VACUUM subjects, embeddings")
                finally:
                    conn.autocommit = False
        except (self._psycopg.Error, self._pool_timeout):
            log.exception("gallery: VACUUM after a delete failed")

    # ------------------------------------------------------------------ subjects
    def _write_imported(self, conn: Any, gid: int, ids: list[str], emb: np.ndarray, q: np.ndarray, now: float) -> None:
        conn.execute("DELETE FROM subjects WHERE gallery_id = %s AND subject_id = ANY(%s)", (gid, ids))
        before = int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM subjects").fetchone()[0])
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY subjects (gallery_id, subject_id, template, template_quality, n_embeddings,"
                " created_at, updated_at) FROM STDIN"
            ) as copy,
        ):
            for sid, e, qi in zip(ids, emb, q, strict=True):
                copy.write_row((gid, sid, pack_vector(e), float(qi), 1, now, now))
        conn.execute(
            "INSERT INTO embeddings (subject_pk, vector, quality, created_at)"
            " SELECT id, template, template_quality, created_at FROM subjects WHERE gallery_id = %s AND id > %s",
            (gid, before),
        )

    # ------------------------------------------------------------------ change feed
    def wait_for_change(self, after: int, timeout_s: float) -> bool:
        """Wait for a NOTIFY on :data:`CHANNEL` (up to ``timeout_s``); whether the sequence moved past ``after``."""
        with self._listen_lock:
            try:
                if self._listen is None or self._listen.closed:
                    self._listen = self._psycopg.connect(
                        self._url, autocommit=True, connect_timeout=max(1, int(self._timeout))
                    )
                    self._listen.execute(f"LISTEN {CHANNEL}")
                # a change committed before LISTEN took effect has sent its NOTIFY already
                if self.current_seq() > after:
                    return True
                for _ in self._listen.notifies(timeout=max(0.0, timeout_s), stop_after=1):
                    pass
            except self._psycopg.Error as exc:
                if self._listen is not None:
                    self._listen.close()
                self._listen = None
                raise self._convert(exc, "waiting for changes") from exc
        return self.current_seq() > after

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the pool and the LISTEN connection; later calls raise GalleryError. Idempotent."""
        with self._listen_lock:
            if self._listen is not None:
                self._listen.close()
                self._listen = None
        self._pool.close()

    def __repr__(self) -> str:
        return f"PostgresGalleryStore({self.redacted_url!r})"


__all__ = ["CHANNEL", "SCHEMA_VERSION", "WRITE_LOCK", "PostgresGalleryStore"]
