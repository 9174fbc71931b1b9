"""PostgreSQL gallery backend (psycopg 3, psycopg_pool): several engines and hosts share one database.

Writers NOTIFY :data:`CHANNEL` at commit, which wakes every engine's index. Every write takes the advisory lock
:data:`WRITE_LOCK` and numbers its change rows ``max(seq) + 1``, so sequence order is commit order and the log has
no gaps (with a ``SERIAL`` a follower could skip a lower number that commits late). Each delete runs ``VACUUM`` to
prune the deleted tuples, as far as no older snapshot on the server needs them; WAL segments and base backups keep
them longer (docs/gallery.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from facegate.errors import GalleryError, GalleryUnavailableError
from facegate.gallery.base import RECOUNT, ChangeRow, GalleryStore, pack_vector, read_templates, schema

log = logging.getLogger(__name__)

CHANNEL = "facegate_gallery"
WRITE_LOCK = 0x4647474C  # advisory lock key (ASCII "FGGL")
SCHEMA_VERSION = 2  # kept in ``facegate_schema``

_DDL = (
    "CREATE TABLE IF NOT EXISTS facegate_schema (version INTEGER NOT NULL)",
    *schema("BIGSERIAL PRIMARY KEY", "BIGINT", "BYTEA", "DOUBLE PRECISION", "BIGINT PRIMARY KEY"),
)


class _Qmark:
    """A psycopg connection that takes the shared SQL's ``?`` placeholders (none of it has a literal ``?``)."""

    def __init__(self, conn: Any) -> None:
        self.raw = conn

    def execute(self, sql: str, params: Any = None) -> Any:
        return self.raw.execute(sql.replace("?", "%s"), params)

    def executemany(self, sql: str, params: Any) -> None:
        with self.raw.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), params)


class PostgresGalleryStore(GalleryStore):
    """The store on the database of libpq URL ``url``, with at most 4 connections;
    ``connect_timeout_s``: how long start-up and each call wait for one before GalleryUnavailableError."""

    _BYTE_ORDER = ' COLLATE "C"'  # byte order (as SQLite's BINARY), whatever the database's locale

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0) -> None:
        self._url = url
        self._connect_kw = {"connect_timeout": max(1, int(connect_timeout_s))}  # libpq's, in whole seconds
        self._listen: Any = None
        self._listen_lock = threading.Lock()
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=4,
            timeout=connect_timeout_s,
            kwargs=self._connect_kw,
            # one empty query per checkout: a connection the server dropped (a restart, a failover) is replaced
            # before use instead of failing the request that drew it
            check=ConnectionPool.check_connection,
            open=False,
            name="facegate-gallery",
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
            self._migrate()
        except BaseException as exc:
            self._pool.close()
            if isinstance(exc, PoolTimeout):
                msg = f"cannot reach the gallery database within {connect_timeout_s:g} s"
                raise GalleryUnavailableError(msg, detail={"backend": "postgresql"}) from exc
            raise
        log.info("gallery database %s open (PostgreSQL, schema v%d)", self.redacted_url, SCHEMA_VERSION)

    @property
    def redacted_url(self) -> str:
        d = conninfo_to_dict(self._url)
        return f"postgresql://{d.get('user', '')}@{d.get('host', '')}:{d.get('port', '')}/{d.get('dbname', '')}"

    def _convert(self, exc: Exception, what: str) -> GalleryError:
        cls = GalleryUnavailableError if isinstance(exc, PoolTimeout | psycopg.OperationalError) else GalleryError
        return cls(
            f"gallery database error while {what}: {exc}".strip(),
            detail={"backend": "postgresql", "error": type(exc).__name__},
        )

    @contextmanager
    def _tx(self, what: str, *, write: bool, snapshot: bool = False) -> Iterator[Any]:
        if self._pool.closed:
            raise GalleryError("the gallery store is closed")
        try:
            with self._pool.connection() as conn, conn.transaction():
                if snapshot:
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                if write:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
                yield _Qmark(conn)
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._convert(exc, what) from exc

    def _migrate(self) -> None:
        with self._tx("creating the schema", write=True) as conn:
            for stmt in _DDL:
                conn.execute(stmt)
            row = conn.execute("SELECT version FROM facegate_schema").fetchone()
            if row is None or int(row[0]) < SCHEMA_VERSION:
                conn.execute("ALTER TABLE galleries ADD COLUMN IF NOT EXISTS subjects BIGINT NOT NULL DEFAULT 0")
                conn.execute(RECOUNT)  # v2: the kept subject count
                conn.execute("DELETE FROM facegate_schema")
                conn.execute("INSERT INTO facegate_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
            elif int(row[0]) > SCHEMA_VERSION:
                raise self._newer_schema("the gallery database", int(row[0]), SCHEMA_VERSION)

    def _log(self, conn: Any, rows: list[ChangeRow], now: float) -> int:
        last = super()._log(conn, rows, now)  # the caller holds WRITE_LOCK
        conn.execute("SELECT pg_notify(?, ?)", (CHANNEL, str(last)))  # delivered at commit
        return last

    def _templates(self, conn: Any, gid: int, dim: int, gallery: str) -> tuple[list[str], np.ndarray]:
        # one server-side cursor, bytea in binary, no sort (a 1M-row sort spills to disk)
        with conn.raw.cursor(name="facegate_templates", binary=True) as cur:
            cur.execute("SELECT subject_id, template FROM subjects WHERE gallery_id = %s", (gid,))
            return read_templates(cur, dim, gallery)

    def _erase_deleted(self) -> None:
        # best effort: an older snapshot elsewhere can keep the dead tuples
        try:
            with self._pool.connection() as conn:
                conn.autocommit = True
                try:
                    conn.execute("VACUUM subjects, embeddings")
                finally:
                    conn.autocommit = False
        except (psycopg.Error, PoolTimeout):
            log.exception("gallery: VACUUM after a delete failed")

    def _write_imported(self, conn: Any, gid: int, ids: list[str], emb: np.ndarray, q: np.ndarray, now: float) -> int:
        # one DELETE and one COPY: no statement per subject
        conn.execute("DELETE FROM subjects WHERE gallery_id = ? AND subject_id = ANY(?)", (gid, ids))
        before = int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM subjects").fetchone()[0])
        with (
            conn.raw.cursor() as cur,
            cur.copy(
                "COPY subjects (gallery_id, subject_id, template, template_quality, n_embeddings,"
                " created_at, updated_at) FROM STDIN"
            ) as copy,
        ):
            for sid, e, qi in zip(ids, emb, q, strict=True):
                copy.write_row((gid, sid, pack_vector(e), float(qi), 1, now, now))
        return before

    def wait_for_change(self, after: int, timeout_s: float) -> bool:
        with self._listen_lock:
            try:
                if self._listen is None or self._listen.closed:
                    self._listen = psycopg.connect(self._url, autocommit=True, **self._connect_kw)
                    self._listen.execute(f"LISTEN {CHANNEL}")
                # a change committed before LISTEN took effect has sent its NOTIFY already
                if self.current_seq() > after:
                    return True
                for _ in self._listen.notifies(timeout=max(0.0, timeout_s), stop_after=1):
                    pass
            except psycopg.Error as exc:
                if self._listen is not None:
                    self._listen.close()
                self._listen = None
                raise self._convert(exc, "waiting for changes") from exc
        return self.current_seq() > after

    def close(self) -> None:
        with self._listen_lock:
            if self._listen is not None:
                self._listen.close()
                self._listen = None
        self._pool.close()
