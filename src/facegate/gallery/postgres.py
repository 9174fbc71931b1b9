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
becomes :class:`~facegate.errors.GalleryUnavailableError` (HTTP 503).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from facegate.errors import (
    GalleryError,
    GalleryExistsError,
    GalleryNotFoundError,
    GalleryUnavailableError,
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

_SUBJECT_COLS = "subject_id, n_embeddings, template_quality, meta, created_at, updated_at"


def _to_blob(vec: np.ndarray) -> bytes:
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()


def _from_blob(blob: bytes, dim: int) -> np.ndarray:
    if len(blob) != 4 * dim:
        raise GalleryError(f"corrupt vector in the gallery database: {len(blob)} bytes, expected {4 * dim}")
    return np.frombuffer(bytes(blob), dtype="<f4").astype(np.float32)


def _subject_info(row: tuple[Any, ...]) -> SubjectInfo:
    sid, n, tq, meta, created, updated = row
    return SubjectInfo(str(sid), int(n), float(tq), decode_meta(meta), float(created), float(updated))


class PostgresGalleryStore:
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

    @staticmethod
    def _log(conn: Any, rows: list[tuple[str, str, str | None]], now: float) -> None:
        """Append change rows ``(op, gallery, subject_id)`` numbered after the current maximum (the caller
        holds :data:`WRITE_LOCK`), and notify the followers (delivered at commit)."""
        base = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO changes (seq, op, gallery, subject_id, committed_at) VALUES (%s, %s, %s, %s, %s)",
                [(base + i + 1, op, g, s, now) for i, (op, g, s) in enumerate(rows)],
            )
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(base + len(rows))))

    @staticmethod
    def _gallery_row(conn: Any, name: str) -> tuple[int, str, int, float]:
        row = conn.execute("SELECT id, model, dim, created_at FROM galleries WHERE name = %s", (name,)).fetchone()
        if row is None:
            raise GalleryNotFoundError(f"no gallery named {name!r}", detail={"gallery": name})
        return int(row[0]), str(row[1]), int(row[2]), float(row[3])

    @staticmethod
    def _missing(gallery: str, subject_id: str) -> SubjectNotFoundError:
        return SubjectNotFoundError(
            f"no subject {subject_id!r} in gallery {gallery!r}", detail={"gallery": gallery, "subject_id": subject_id}
        )

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

    # ------------------------------------------------------------------ galleries
    def create_gallery(self, name: str, model: str, dim: int) -> GalleryInfo:
        """Create an empty gallery; raises GalleryExistsError / InvalidParameterError."""
        validate_gallery_name(name)
        validate_gallery_name(model, what="model name")
        dim = validate_dim(dim)
        now = time.time()
        with self._tx(f"creating gallery {name!r}", write=True) as conn:
            if conn.execute("SELECT 1 FROM galleries WHERE name = %s", (name,)).fetchone():
                raise GalleryExistsError(f"gallery {name!r} already exists", detail={"gallery": name})
            conn.execute(
                "INSERT INTO galleries (name, model, dim, created_at) VALUES (%s, %s, %s, %s)", (name, model, dim, now)
            )
            self._log(conn, [("create_gallery", name, None)], now)
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
            n = conn.execute("SELECT COUNT(*) FROM subjects WHERE gallery_id = %s", (gid,)).fetchone()[0]
        return GalleryInfo(name=name, model=model, dim=dim, created_at=created, subjects=int(n))

    def delete_gallery(self, name: str) -> None:
        """Delete a gallery, its subjects and their embeddings; raises GalleryNotFoundError."""
        validate_gallery_name(name)
        with self._tx(f"deleting gallery {name!r}", write=True) as conn:
            gid = self._gallery_row(conn, name)[0]
            conn.execute("DELETE FROM galleries WHERE id = %s", (gid,))
            self._log(conn, [("delete_gallery", name, None)], time.time())
        self._vacuum()

    # ------------------------------------------------------------------ subjects
    def add_embeddings(
        self,
        gallery: str,
        subject_id: str,
        embeddings: np.ndarray,
        qualities: np.ndarray,
        meta: dict[str, Any] | None = None,
    ) -> SubjectInfo:
        """Append ``(k, D) float32`` unit-norm embeddings with ``(k,)`` qualities; recompute the template."""
        validate_gallery_name(gallery)
        validate_subject_id(subject_id)
        meta_text = encode_meta(meta)
        with self._tx(f"enrolling {subject_id!r} in {gallery!r}", write=True) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            emb, q = validate_embeddings(embeddings, qualities, dim)
            now = time.time()
            row = conn.execute(
                "SELECT id FROM subjects WHERE gallery_id = %s AND subject_id = %s", (gid, subject_id)
            ).fetchone()
            if row is None:
                spk = int(
                    conn.execute(
                        "INSERT INTO subjects (gallery_id, subject_id, meta, template, template_quality,"
                        " n_embeddings, created_at, updated_at) VALUES (%s, %s, %s, '', 0, 0, %s, %s) RETURNING id",
                        (gid, subject_id, meta_text or "{}", now, now),
                    ).fetchone()[0]
                )
            else:
                spk = int(row[0])
                if meta_text is not None:
                    conn.execute("UPDATE subjects SET meta = %s WHERE id = %s", (meta_text, spk))
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO embeddings (subject_pk, vector, quality, created_at) VALUES (%s, %s, %s, %s)",
                    [(spk, _to_blob(e), float(qi), now) for e, qi in zip(emb, q, strict=True)],
                )
            stored = conn.execute(
                "SELECT vector, quality FROM embeddings WHERE subject_pk = %s ORDER BY id", (spk,)
            ).fetchall()
            all_e = np.stack([_from_blob(v, dim) for v, _ in stored])
            all_q = np.asarray([qq for _, qq in stored], dtype=np.float32)
            template = quality_weighted_template(all_e, all_q)
            conn.execute(
                "UPDATE subjects SET template = %s, template_quality = %s, n_embeddings = %s, updated_at = %s"
                " WHERE id = %s",
                (_to_blob(template), template_quality(all_q), len(stored), now, spk),
            )
            self._log(conn, [("enrol", gallery, subject_id)], now)
            out = conn.execute(f"SELECT {_SUBJECT_COLS} FROM subjects WHERE id = %s", (spk,)).fetchone()
        return _subject_info(out)

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
                    copy.write_row((gid, sid, _to_blob(e), float(qi), 1, now, now))
            conn.execute(
                "INSERT INTO embeddings (subject_pk, vector, quality, created_at)"
                " SELECT id, template, template_quality, created_at FROM subjects WHERE gallery_id = %s AND id > %s",
                (gid, before),
            )
            self._log(conn, [("enrol", gallery, sid) for sid in ids], now)
        return len(ids)

    def get_subject(self, gallery: str, subject_id: str) -> SubjectInfo:
        """One subject; raises GalleryNotFoundError / SubjectNotFoundError."""
        validate_gallery_name(gallery)
        validate_subject_id(subject_id)
        with self._tx(f"reading {subject_id!r} in {gallery!r}", write=False) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            row = conn.execute(
                f"SELECT {_SUBJECT_COLS} FROM subjects WHERE gallery_id = %s AND subject_id = %s", (gid, subject_id)
            ).fetchone()
        if row is None:
            raise self._missing(gallery, subject_id)
        return _subject_info(row)

    def get_template(self, gallery: str, subject_id: str) -> np.ndarray:
        """A subject's stored ``(D,) float32`` template."""
        validate_gallery_name(gallery)
        validate_subject_id(subject_id)
        with self._tx(f"reading template of {subject_id!r}", write=False) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            row = conn.execute(
                "SELECT template FROM subjects WHERE gallery_id = %s AND subject_id = %s", (gid, subject_id)
            ).fetchone()
        if row is None:
            raise self._missing(gallery, subject_id)
        return _from_blob(row[0], dim)

    def list_subjects(self, gallery: str, offset: int = 0, limit: int = 100) -> list[SubjectInfo]:
        """A page of subjects ordered by ``subject_id``."""
        validate_gallery_name(gallery)
        offset, limit = validate_page(offset, limit)
        with self._tx(f"listing subjects of {gallery!r}", write=False) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            rows = conn.execute(
                f"SELECT {_SUBJECT_COLS} FROM subjects WHERE gallery_id = %s"
                ' ORDER BY subject_id COLLATE "C" LIMIT %s OFFSET %s',
                (gid, limit, offset),
            ).fetchall()
        return [_subject_info(r) for r in rows]

    def delete_subject(self, gallery: str, subject_id: str) -> None:
        """Erase a subject and (by cascade) its embeddings, then VACUUM (see the module docstring)."""
        validate_gallery_name(gallery)
        validate_subject_id(subject_id)
        with self._tx(f"deleting {subject_id!r} from {gallery!r}", write=True) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            cur = conn.execute("DELETE FROM subjects WHERE gallery_id = %s AND subject_id = %s", (gid, subject_id))
            if cur.rowcount == 0:
                raise self._missing(gallery, subject_id)
            self._log(conn, [("delete_subject", gallery, subject_id)], time.time())
        self._vacuum()

    def load_templates(self, gallery: str) -> tuple[list[str], np.ndarray]:
        """``(subject_ids, (S, D) float32 templates)`` of a gallery, ordered by ``subject_id``."""
        validate_gallery_name(gallery)
        with self._tx(f"loading templates of {gallery!r}", write=False) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            return self._templates(conn, gid, dim, gallery)

    def _templates(self, conn: Any, gid: int, dim: int, gallery: str) -> tuple[list[str], np.ndarray]:
        with conn.cursor(binary=True) as cur:
            cur.execute(
                'SELECT subject_id, template FROM subjects WHERE gallery_id = %s ORDER BY subject_id COLLATE "C"',
                (gid,),
            )
            rows = cur.fetchall()
        ids = [str(r[0]) for r in rows]
        if not rows:
            return ids, np.zeros((0, dim), dtype=np.float32)
        blob = b"".join(bytes(r[1]) for r in rows)
        if len(blob) != 4 * dim * len(rows):
            raise GalleryError(f"corrupt template in gallery {gallery!r}", detail={"gallery": gallery})
        return ids, np.frombuffer(blob, dtype="<f4").astype(np.float32).reshape(len(rows), dim)

    # ------------------------------------------------------------------ change feed
    def current_seq(self) -> int:
        """The last committed change's sequence number (0 when none)."""
        with self._tx("reading the change sequence", write=False) as conn:
            return int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])

    def changes_since(self, seq: int, limit: int = 10_000) -> list[Change]:
        """Up to ``limit`` changes after ``seq`` with the current state they refer to (one snapshot)."""
        with self._tx("reading the change feed", write=False, snapshot=True) as conn:
            rows = conn.execute(
                "SELECT c.seq, c.op, c.gallery, c.subject_id, c.committed_at, g.dim, s.template"
                " FROM changes c LEFT JOIN galleries g ON g.name = c.gallery"
                " LEFT JOIN subjects s ON s.gallery_id = g.id AND s.subject_id = c.subject_id"
                " WHERE c.seq > %s ORDER BY c.seq LIMIT %s",
                (int(seq), int(limit)),
            ).fetchall()
        out = []
        for sq, op, gal, sid, at, dim, blob in rows:
            tpl = _from_blob(blob, int(dim)) if blob is not None and dim is not None else None
            out.append(Change(int(sq), str(op), str(gal), sid, float(at), None if dim is None else int(dim), tpl))
        return out

    def load_snapshot(self) -> StoreSnapshot:
        """Every gallery's templates and the sequence number they are current at (one snapshot)."""
        galleries: dict[str, tuple[int, list[str], np.ndarray]] = {}
        with self._tx("loading every gallery", write=False, snapshot=True) as conn:
            seq = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])
            for gid, name, dim in conn.execute("SELECT id, name, dim FROM galleries ORDER BY name").fetchall():
                galleries[str(name)] = (int(dim), *self._templates(conn, int(gid), int(dim), str(name)))
        return StoreSnapshot(seq=seq, galleries=galleries)

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

    def __enter__(self) -> PostgresGalleryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PostgresGalleryStore({self.redacted_url!r})"


__all__ = ["CHANNEL", "SCHEMA_VERSION", "WRITE_LOCK", "PostgresGalleryStore"]
