"""The gallery store: result types, validation, template math, and the SQL both backends share.

A subject holds one embedding per enrolment image and one unit-norm template for 1:N search
(:func:`quality_weighted_template`). Every mutation commits in the same transaction as a change-log row with a
gap-free sequence number (the feed an index follows). Only FacegateError subclasses escape; a write returns once
durable.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from facegate.errors import (
    DimensionMismatchError,
    GalleryError,
    GalleryExistsError,
    GalleryNotFoundError,
    InvalidParameterError,
    SubjectNotFoundError,
)

GALLERY_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
SUBJECT_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.@:-]{1,128}$")
TEMPLATE_WEIGHT_FLOOR = 1e-3
MAX_DIM = 8192
NORM_TOLERANCE = 1e-3  # on ‖e‖₂ = 1
MAX_META_BYTES = 16 * 1024  # JSON-encoded, per subject
MAX_PAGE = 10_000
GALLERY_COLS = "name, model, dim, created_at, subjects"
SUBJECT_COLS = "subject_id, n_embeddings, template_quality, meta, created_at, updated_at"
#: Sets ``galleries.subjects``, the kept count (a ``COUNT(*)`` per request would scan every subject).
RECOUNT = "UPDATE galleries SET subjects = (SELECT COUNT(*) FROM subjects s WHERE s.gallery_id = galleries.id)"


def schema(key: str, ref: str, blob: str, real: str, seq: str) -> tuple[str, ...]:
    """The current tables in one backend's column types: ``key`` a generated primary key, ``ref`` a reference to
    one, ``blob`` bytes, ``real`` a float64, ``seq`` the change log's key. The change log comes last."""
    return (
        f"""CREATE TABLE IF NOT EXISTS galleries (
            id {key}, name TEXT NOT NULL UNIQUE, model TEXT NOT NULL, dim INTEGER NOT NULL CHECK (dim > 0),
            created_at {real} NOT NULL, subjects {ref} NOT NULL DEFAULT 0)""",
        f"""CREATE TABLE IF NOT EXISTS subjects (
            id {key}, gallery_id {ref} NOT NULL REFERENCES galleries(id) ON DELETE CASCADE,
            subject_id TEXT NOT NULL, meta TEXT NOT NULL DEFAULT '{{}}', template {blob} NOT NULL,
            template_quality REAL NOT NULL, n_embeddings INTEGER NOT NULL, created_at {real} NOT NULL,
            updated_at {real} NOT NULL, UNIQUE (gallery_id, subject_id))""",
        f"""CREATE TABLE IF NOT EXISTS embeddings (
            id {key}, subject_pk {ref} NOT NULL REFERENCES subjects(id) ON DELETE CASCADE,
            vector {blob} NOT NULL, quality REAL NOT NULL, created_at {real} NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS embeddings_by_subject ON embeddings(subject_pk)",
        f"""CREATE TABLE IF NOT EXISTS changes (
            seq {seq}, op TEXT NOT NULL, gallery TEXT NOT NULL, subject_id TEXT, committed_at {real} NOT NULL)""",
    )


@dataclass(frozen=True, slots=True)
class GalleryInfo:
    """One gallery: ``created_at`` in Unix seconds, ``subjects`` its number of subjects."""

    name: str
    model: str
    dim: int
    created_at: float
    subjects: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def check_model(self, model: str, dim: int) -> None:
        """DimensionMismatchError (409) unless this gallery holds ``model``'s embeddings of dimension ``dim``."""
        if (self.model, self.dim) != (model, dim):
            raise DimensionMismatchError(
                f"gallery {self.name!r} holds {self.model} embeddings (dim {self.dim}); "
                f"the server runs {model} (dim {dim})",
                detail={"gallery_model": self.model, "gallery_dim": self.dim, "model": model},
            )


@dataclass(frozen=True, slots=True)
class SubjectInfo:
    """One subject: ``template_quality`` = max quality of its ``n_embeddings``; times in Unix seconds."""

    subject_id: str
    n_embeddings: int
    template_quality: float
    meta: dict[str, Any] = field(hash=False)
    created_at: float
    updated_at: float

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "template_quality": round(float(self.template_quality), 5)}  # asdict copies meta


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One candidate of a 1:N search: rank (1 = best), cosine similarity, whether it clears the match threshold."""

    rank: int
    subject_id: str
    score: float
    match: bool


@dataclass(frozen=True, slots=True)
class Change:
    """One change-log entry (``op``: create_gallery, delete_gallery, enrol or delete_subject), state-based:
    ``dim`` and ``template`` (``(D,) float32``) are the gallery's and the subject's *as the store holds them
    when the feed is read* (``None`` once gone), so replaying in sequence order converges on the store's
    state and no erased template lives on in the log."""

    seq: int
    op: str
    gallery: str
    subject_id: str | None
    committed_at: float
    dim: int | None = None
    template: np.ndarray | None = field(default=None, hash=False, compare=False)


# --------------------------------------------------------------------------- validation
#: Names a URL path cannot carry as one segment: browsers, curl and httpx resolve them as dot-segments, so
#: ``DELETE /api/galleries/g/subjects/..`` would reach ``DELETE /api/galleries/g``. Refused for new names only:
#: one stored before stays readable and deletable.
DOT_SEGMENTS = frozenset({".", ".."})


def _name(value: object, pattern: re.Pattern[str], what: str, field: str, rule: str, new: bool) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value) or (new and value in DOT_SEGMENTS):
        raise InvalidParameterError(
            f"invalid {what} {value!r}: {rule}, not '.' or '..'" if new else f"invalid {what} {value!r}: {rule}",
            detail={"field": field, "pattern": pattern.pattern},
        )
    return value


def validate_gallery_name(name: object, *, what: str = "gallery name", new: bool = False) -> str:
    """A gallery name; ``new``: one being created (not a URL dot-segment either)."""
    return _name(name, GALLERY_NAME_PATTERN, what, what, "1-64 characters of A-Z a-z 0-9 _ . -", new)


def validate_subject_id(subject_id: object, *, new: bool = False) -> str:
    """A subject id; ``new``: one being written (not a URL dot-segment either)."""
    rule = "1-128 characters of A-Z a-z 0-9 _ . - @ :"
    return _name(subject_id, SUBJECT_ID_PATTERN, "subject id", "subject_id", rule, new)


def _int_in(value: object, lo: int, hi: float) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and lo <= int(value) <= hi


def encode_meta(meta: dict[str, Any] | None) -> str | None:
    """Canonical JSON text of ``meta`` (``None`` passes through); it must be a JSON object."""
    if meta is None:
        return None
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise InvalidParameterError("meta must be a JSON object with string keys", detail={"field": "meta"})
    try:
        text = json.dumps(meta, ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(f"meta is not JSON-serialisable: {exc}", detail={"field": "meta"}) from exc
    if len(text.encode("utf-8")) > MAX_META_BYTES:
        raise InvalidParameterError(f"meta exceeds {MAX_META_BYTES} bytes once JSON-encoded", detail={"field": "meta"})
    return text


def validate_embeddings(embeddings: object, qualities: object, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(k, D) float32`` C-contiguous unit-norm embeddings and ``(k,) float32`` qualities in ``[0, 1]``; raises
    DimensionMismatchError when ``D != dim``, InvalidParameterError for anything else malformed."""
    emb = np.asarray(embeddings)
    q = np.asarray(qualities)
    if emb.ndim != 2 or emb.shape[0] < 1 or not np.issubdtype(emb.dtype, np.floating):
        raise InvalidParameterError(
            f"embeddings must be a non-empty (k, D) float array, got shape {emb.shape} dtype {emb.dtype}",
            detail={"field": "embeddings"},
        )
    if emb.shape[1] != dim:
        raise DimensionMismatchError(
            f"embedding dimension {emb.shape[1]} does not match the gallery's {dim}",
            detail={"expected": dim, "got": int(emb.shape[1])},
        )
    if q.shape != (emb.shape[0],) or not (np.issubdtype(q.dtype, np.floating) or np.issubdtype(q.dtype, np.integer)):
        raise InvalidParameterError(
            f"qualities must be a ({emb.shape[0]},) numeric array, got shape {q.shape}", detail={"field": "qualities"}
        )
    emb32 = np.ascontiguousarray(emb, dtype=np.float32)
    q32 = np.ascontiguousarray(q, dtype=np.float32)
    if not np.isfinite(emb32).all():
        raise InvalidParameterError("embeddings contain NaN or inf", detail={"field": "embeddings"})
    norms = np.linalg.norm(emb32.astype(np.float64), axis=1)
    if np.any(np.abs(norms - 1.0) > NORM_TOLERANCE):
        raise InvalidParameterError(
            "embeddings must be L2-normalised (every row of norm 1)",
            detail={"field": "embeddings", "norms": [round(float(n), 6) for n in norms[:8]]},
        )
    if not np.isfinite(q32).all() or np.any(q32 < 0.0) or np.any(q32 > 1.0):
        raise InvalidParameterError("qualities must be calibrated values in [0, 1]", detail={"field": "qualities"})
    return emb32, q32


# --------------------------------------------------------------------------- template math and packing
def quality_weighted_template(embeddings: np.ndarray, qualities: np.ndarray) -> np.ndarray:
    """``(D,) float32`` unit-norm ``Σ wᵢ·eᵢ / ‖Σ wᵢ·eᵢ‖₂`` of ``(n, D)`` embeddings with ``wᵢ = max(qᵢ,
    TEMPLATE_WEIGHT_FLOOR)`` for ``(n,)`` qualities (the embedding of highest weight if the sum vanishes); computed
    in float64, rounded once, so every backend agrees bit for bit."""
    e = np.asarray(embeddings, dtype=np.float64)
    w = np.maximum(np.asarray(qualities, dtype=np.float64), TEMPLATE_WEIGHT_FLOOR)
    s = w @ e
    norm = float(np.linalg.norm(s))
    if not math.isfinite(norm) or norm < 1e-12:
        s = e[int(np.argmax(w))]
        norm = float(np.linalg.norm(s))
    return (s / norm).astype(np.float32)


def pack_vector(vec: np.ndarray) -> bytes:
    """Raw little-endian float32 bytes: how embeddings and templates are stored."""
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()


def unpack_vector(blob: bytes | bytearray | memoryview, dim: int) -> np.ndarray:
    if len(blob) != 4 * dim:
        raise GalleryError(
            f"corrupt vector in the gallery database: {len(blob)} bytes, expected {4 * dim}",
            detail={"bytes": len(blob), "dim": dim},
        )
    return np.frombuffer(bytes(blob), dtype="<f4").astype(np.float32)


def read_templates(cur: Any, dim: int, gallery: str) -> tuple[list[str], np.ndarray]:
    """``(subject_ids, (S, D) float32)`` from a cursor over ``(subject_id, template bytes)`` rows, fetched 65,536
    rows at a time: a 1M-subject load holds one chunk's bytes, never all of them twice."""
    ids: list[str] = []
    parts = [np.zeros((0, dim), np.float32)]
    while rows := cur.fetchmany(65_536):
        blob = b"".join([r[1] for r in rows])
        if len(blob) != 4 * dim * len(rows):
            raise GalleryError(f"corrupt template in gallery {gallery!r}", detail={"gallery": gallery})
        ids += [str(r[0]) for r in rows]
        parts.append(np.frombuffer(blob, "<f4").reshape(len(rows), dim))
    return ids, np.concatenate(parts).astype(np.float32, copy=False)


def _subject(row: tuple[Any, ...]) -> SubjectInfo:
    sid, n, tq, meta, created, updated = row  # meta: encode_meta's JSON object text, or the column's default '{}'
    return SubjectInfo(str(sid), int(n), float(tq), json.loads(meta), float(created), float(updated))


def _subject_not_found(gallery: str, subject_id: str) -> SubjectNotFoundError:
    return SubjectNotFoundError(
        f"no subject {subject_id!r} in gallery {gallery!r}", detail={"gallery": gallery, "subject_id": subject_id}
    )


#: One change-log row: ``(op, gallery, subject_id)``.
ChangeRow = tuple[str, str, str | None]
#: One subject of :meth:`GalleryStore.enrol_many`: ``(subject_id, (k, D) embeddings, (k,) qualities, meta)``.
EnrolItem = tuple[str, np.ndarray, np.ndarray, "dict[str, Any] | None"]


class GalleryStore(AbstractContextManager):
    """Durable gallery storage (SQLite or PostgreSQL). Thread-safe; each call is one transaction. A backend's
    :meth:`_tx` yields a connection that takes ``?`` placeholders, with ``execute`` and ``executemany`` (cursors
    with ``fetchone``/``fetchall``/``rowcount``)."""

    _BYTE_ORDER = ""  # ``ORDER BY subject_id`` + this sorts by bytes on every backend

    # ------------------------------------------------------------------ backend steps
    def _tx(self, what: str, *, write: bool, snapshot: bool = False) -> AbstractContextManager[Any]:
        """One transaction (``write``: serialised with every other writer; ``snapshot``: every read in it
        sees one snapshot); driver errors become GalleryError naming ``what``."""
        raise NotImplementedError

    def _log(self, conn: Any, rows: list[ChangeRow], now: float) -> int:
        """Append change rows inside the caller's write transaction, numbered ``max(seq) + 1`` on: writers are
        serialised, so sequence order is commit order and the log has no gaps. Returns the last number."""
        last = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])
        conn.executemany(
            "INSERT INTO changes (seq, op, gallery, subject_id, committed_at) VALUES (?, ?, ?, ?, ?)",
            [(last + i, op, g, s, now) for i, (op, g, s) in enumerate(rows, 1)],
        )
        return last + len(rows)

    def _write_imported(self, conn: Any, gid: int, ids: list[str], emb: np.ndarray, q: np.ndarray, now: float) -> int:
        """Replace subjects ``ids`` by subjects of template ``emb[i]`` (their embeddings follow); returns the largest
        ``subjects.id`` before the new rows."""
        conn.executemany("DELETE FROM subjects WHERE gallery_id = ? AND subject_id = ?", [(gid, sid) for sid in ids])
        before = int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM subjects").fetchone()[0])
        conn.executemany(
            "INSERT INTO subjects (gallery_id, subject_id, meta, template, template_quality,"
            " n_embeddings, created_at, updated_at) VALUES (?, ?, '{}', ?, ?, 1, ?, ?)",
            [(gid, sid, pack_vector(e), float(qi), now, now) for sid, e, qi in zip(ids, emb, q, strict=True)],
        )
        return before

    @staticmethod
    def _newer_schema(where: str, version: int, supported: int) -> GalleryError:
        return GalleryError(
            f"{where} has gallery schema v{version}; this facegate knows up to v{supported}",
            detail={"schema": version, "supported": supported},
        )

    def _templates(self, conn: Any, gid: int, dim: int, gallery: str) -> tuple[list[str], Any]:
        """``(subject_ids, (S, D) float32)`` of gallery ``gid``, here by subject id (free: the UNIQUE index's order)."""
        sql = "SELECT subject_id, template FROM subjects WHERE gallery_id = ? ORDER BY subject_id"
        return read_templates(conn.execute(sql, (gid,)), dim, gallery)

    def _erase_deleted(self) -> None:
        raise NotImplementedError  # after a committed delete: drop the deleted bytes, as far as the backend can

    def erase_pending(self) -> None:
        """Finish an erasure that :class:`~facegate.errors.ErasureIncompleteError` reported (nothing where a backend
        never reports one)."""

    @contextmanager
    def _erasing(self) -> Iterator[None]:
        """Around a delete's transaction: the erasure step once it committed; before a not-found answer, the
        erasure a retry of an ``erasure_incomplete`` delete comes to finish."""
        try:
            yield
        except (GalleryNotFoundError, SubjectNotFoundError):
            self.erase_pending()
            raise
        self._erase_deleted()

    def wait_for_change(self, after: int, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a change after ``after`` may have committed (spurious True allowed).
        Here: poll ``current_seq`` every 5 ms (SQLite has no notifications)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while (seen := self.current_seq()) <= after and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.005, left))
        return seen > after

    def close(self) -> None:
        raise NotImplementedError  # idempotent; later calls raise GalleryError

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _in_gallery(self, gallery: str, what: str, *, write: bool = False) -> Iterator[tuple[Any, int, int]]:
        """A transaction on gallery ``gallery``: ``(conn, gallery id, dim)``; raises GalleryNotFoundError. A read
        sees one snapshot, so its statements after the lookup never straddle another process's delete."""
        validate_gallery_name(gallery)
        with self._tx(what, write=write, snapshot=not write) as conn:
            row = conn.execute("SELECT id, dim FROM galleries WHERE name = ?", (gallery,)).fetchone()
            if row is None:
                raise GalleryNotFoundError(f"no gallery named {gallery!r}", detail={"gallery": gallery})
            yield conn, int(row[0]), int(row[1])

    # ------------------------------------------------------------------ galleries
    def create_gallery(self, name: str, model: str, dim: int) -> GalleryInfo:
        validate_gallery_name(name, new=True)
        validate_gallery_name(model, what="model name")
        if not _int_in(dim, 1, MAX_DIM):
            raise InvalidParameterError(f"invalid dim {dim!r}: an integer in [1, {MAX_DIM}]", detail={"field": "dim"})
        now = time.time()
        with self._tx(f"creating gallery {name!r}", write=True) as conn:
            if conn.execute("SELECT 1 FROM galleries WHERE name = ?", (name,)).fetchone():
                raise GalleryExistsError(f"gallery {name!r} already exists", detail={"gallery": name})
            sql = "INSERT INTO galleries (name, model, dim, created_at) VALUES (?, ?, ?, ?)"
            conn.execute(sql, (name, model, int(dim), now))
            self._log(conn, [("create_gallery", name, None)], now)
        return GalleryInfo(name=name, model=model, dim=int(dim), created_at=now, subjects=0)

    def list_galleries(self) -> list[GalleryInfo]:
        with self._tx("listing galleries", write=False) as conn:
            rows = conn.execute(f"SELECT {GALLERY_COLS} FROM galleries ORDER BY name").fetchall()
        return [GalleryInfo(*r) for r in rows]  # both drivers give str, str, int, float, int

    def get_gallery(self, name: str) -> GalleryInfo:
        with self._in_gallery(name, f"reading gallery {name!r}") as (conn, gid, _):
            return GalleryInfo(*conn.execute(f"SELECT {GALLERY_COLS} FROM galleries WHERE id = ?", (gid,)).fetchone())

    def delete_gallery(self, name: str) -> None:
        """Delete a gallery with its subjects and embeddings; raises GalleryNotFoundError."""
        with self._erasing(), self._in_gallery(name, f"deleting gallery {name!r}", write=True) as (conn, gid, _):
            conn.execute("DELETE FROM galleries WHERE id = ?", (gid,))
            self._log(conn, [("delete_gallery", name, None)], time.time())

    # ------------------------------------------------------------------ subjects
    def enrol_many(self, gallery: str, items: list[EnrolItem], *, replace: bool = False) -> list[SubjectInfo]:
        """For each ``(subject_id, embeddings, qualities, meta)``: append ``(k, D) float32`` unit-norm embeddings with
        ``(k,)`` qualities to the subject (created if new), recompute its template from all of them, and replace its
        meta unless ``None``. One transaction (one commit, one fsync): all are durable once it returns, none if it
        raises. ``replace``: a subject that exists starts over from these embeddings (as :meth:`import_templates`:
        its earlier ones and meta go)."""
        todo = [(validate_subject_id(sid, new=True), emb, q, encode_meta(meta)) for sid, emb, q, meta in items]
        if not todo:
            return []
        what = f"enrolling {len(todo)} subject(s) in {gallery!r}"
        with self._in_gallery(gallery, what, write=True) as (conn, gid, dim):
            now = time.time()
            infos = [self._enrol_one(conn, gid, dim, item, now, replace) for item in todo]
            self._log(conn, [("enrol", gallery, sid) for sid, *_ in todo], now)
        return infos

    def _enrol_one(
        self, conn: Any, gid: int, dim: int, item: tuple[str, Any, Any, str | None], now: float, replace: bool
    ) -> SubjectInfo:
        """One subject of :meth:`enrol_many`, its meta JSON-encoded already."""
        sid, emb, q, meta = item
        emb, q = validate_embeddings(emb, q, dim)
        row = conn.execute("SELECT id FROM subjects WHERE gallery_id = ? AND subject_id = ?", (gid, sid)).fetchone()
        if row is not None and replace:  # its embeddings go with it (ON DELETE CASCADE); the count stays
            conn.execute("DELETE FROM subjects WHERE id = ?", (int(row[0]),))
        elif row is None:
            conn.execute("UPDATE galleries SET subjects = subjects + 1 WHERE id = ?", (gid,))
        if row is None or replace:
            sql = (
                "INSERT INTO subjects (gallery_id, subject_id, meta, template, template_quality, n_embeddings,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, 0, 0, ?, ?) RETURNING id"
            )
            spk = int(conn.execute(sql, (gid, sid, meta or "{}", b"", now, now)).fetchone()[0])
            all_e, all_q = emb, q  # a new subject holds just these: no need to read them back
        else:
            spk = int(row[0])
            if meta is not None:
                conn.execute("UPDATE subjects SET meta = ? WHERE id = ?", (meta, spk))
            old = conn.execute("SELECT vector, quality FROM embeddings WHERE subject_pk = ? ORDER BY id", (spk,))
            old = old.fetchall()
            all_e = np.concatenate([np.stack([unpack_vector(v, dim) for v, _ in old]).reshape(-1, dim), emb])
            all_q = np.concatenate([np.asarray([qq for _, qq in old], np.float32), q])
        sql = "INSERT INTO embeddings (subject_pk, vector, quality, created_at) VALUES (?, ?, ?, ?)"
        conn.executemany(sql, [(spk, pack_vector(e), float(qi), now) for e, qi in zip(emb, q, strict=True)])
        sql = "UPDATE subjects SET template = ?, template_quality = ?, n_embeddings = ?, updated_at = ? WHERE id = ?"
        args = (pack_vector(quality_weighted_template(all_e, all_q)), float(all_q.max()), len(all_q), now, spk)
        return _subject(conn.execute(f"{sql} RETURNING {SUBJECT_COLS}", args).fetchone())

    def get_subject(self, gallery: str, subject_id: str) -> SubjectInfo:
        validate_subject_id(subject_id)
        with self._in_gallery(gallery, f"reading {subject_id!r} in {gallery!r}") as (conn, gid, _):
            sql = f"SELECT {SUBJECT_COLS} FROM subjects WHERE gallery_id = ? AND subject_id = ?"
            row = conn.execute(sql, (gid, subject_id)).fetchone()
        if row is None:
            raise _subject_not_found(gallery, subject_id)
        return _subject(row)

    def list_subjects(self, gallery: str, offset: int = 0, limit: int = 100) -> list[SubjectInfo]:
        """A page of subjects ordered by ``subject_id``; ``0 <= offset``, ``1 <= limit <= MAX_PAGE``."""
        if not (_int_in(offset, 0, math.inf) and _int_in(limit, 1, MAX_PAGE)):
            raise InvalidParameterError(
                f"invalid page offset={offset!r} limit={limit!r}: offset >= 0, 1 <= limit <= {MAX_PAGE}",
                detail={"field": "offset/limit"},
            )
        with self._in_gallery(gallery, f"listing subjects of {gallery!r}") as (conn, gid, _):
            sql = f"SELECT {SUBJECT_COLS} FROM subjects WHERE gallery_id = ? ORDER BY subject_id{self._BYTE_ORDER}"
            rows = conn.execute(sql + " LIMIT ? OFFSET ?", (gid, int(limit), int(offset))).fetchall()
        return [_subject(r) for r in rows]

    def delete_subject(self, gallery: str, subject_id: str) -> None:
        """Erase a subject and all its embeddings (really removed, then the backend's erasure step)."""
        validate_subject_id(subject_id)
        what = f"deleting {subject_id!r} from {gallery!r}"
        sql = "DELETE FROM subjects WHERE gallery_id = ? AND subject_id = ?"
        with self._erasing(), self._in_gallery(gallery, what, write=True) as (conn, gid, _):
            if conn.execute(sql, (gid, subject_id)).rowcount == 0:
                raise _subject_not_found(gallery, subject_id)
            conn.execute("UPDATE galleries SET subjects = subjects - 1 WHERE id = ?", (gid,))
            self._log(conn, [("delete_subject", gallery, subject_id)], time.time())

    def import_templates(
        self, gallery: str, subject_ids: list[str], templates: np.ndarray, qualities: np.ndarray | None = None
    ) -> int:
        """Bulk enrolment without photos, one transaction: each ``(S, D) float32`` unit-norm row becomes a
        subject's only embedding (replacing what a subject of that id held); qualities default to 1. Returns S."""
        if not isinstance(subject_ids, list | tuple) or not subject_ids:
            raise InvalidParameterError("subject_ids must be a non-empty list", detail={"field": "subject_ids"})
        ids = [validate_subject_id(s, new=True) for s in subject_ids]
        if len(set(ids)) != len(ids):
            raise InvalidParameterError("subject_ids must be unique within one import", detail={"field": "subject_ids"})
        rows = getattr(templates, "shape", (None,))[0]
        if rows != len(ids) or (qualities is not None and getattr(qualities, "shape", (None,))[0] != len(ids)):
            raise InvalidParameterError(
                f"{len(ids)} subject ids need as many template rows and qualities",
                detail={"field": "templates", "ids": len(ids), "rows": rows},
            )
        q = np.ones(len(ids), np.float32) if qualities is None else qualities
        what = f"importing {len(ids)} templates into {gallery!r}"
        with self._in_gallery(gallery, what, write=True) as (conn, gid, dim):
            now = time.time()
            before = self._write_imported(conn, gid, ids, *validate_embeddings(templates, q, dim), now)
            conn.execute(  # writers are serialised: the subjects above ``before`` are the ones just written
                "INSERT INTO embeddings (subject_pk, vector, quality, created_at)"
                " SELECT id, template, template_quality, created_at FROM subjects WHERE id > ?",
                (before,),
            )
            conn.execute(RECOUNT + " WHERE id = ?", (gid,))
            self._log(conn, [("enrol", gallery, sid) for sid in ids], now)
        return len(ids)

    # ------------------------------------------------------------------ change feed
    def current_seq(self) -> int:
        """The last committed change's sequence number (0 when none); a cheap read."""
        with self._tx("reading the change sequence", write=False) as conn:
            return int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])

    def changes_since(self, seq: int, limit: int = 10_000) -> list[Change]:
        """Up to ``limit`` changes after ``seq``, in order, with the state they refer to (one snapshot)."""
        with self._tx("reading the change feed", write=False, snapshot=True) as conn:
            rows = conn.execute(
                "SELECT c.seq, c.op, c.gallery, c.subject_id, c.committed_at, g.dim, s.template"
                " FROM changes c LEFT JOIN galleries g ON g.name = c.gallery"
                " LEFT JOIN subjects s ON s.gallery_id = g.id AND s.subject_id = c.subject_id"
                " WHERE c.seq > ? ORDER BY c.seq LIMIT ?",
                (int(seq), int(limit)),
            ).fetchall()
        # a subject's template comes with its gallery's dim (the join on galleries)
        return [
            Change(int(sq), str(op), str(gal), sid, float(at), dim, None if blob is None else unpack_vector(blob, dim))
            for sq, op, gal, sid, at, dim, blob in rows
        ]

    def load_snapshot(self) -> tuple[int, dict[str, tuple[int, list[str], np.ndarray]]]:
        """Every gallery as of one change ``seq`` (the start-up load): ``(seq, {name: (dim, subject_ids, (S, D)
        float32 templates)})``."""
        galleries: dict[str, tuple[int, list[str], np.ndarray]] = {}
        with self._tx("loading every gallery", write=False, snapshot=True) as conn:
            seq = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])
            for gid, name, dim in conn.execute("SELECT id, name, dim FROM galleries ORDER BY name").fetchall():
                galleries[str(name)] = (int(dim), *self._templates(conn, int(gid), int(dim), str(name)))
        return seq, galleries
