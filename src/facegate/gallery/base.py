"""The gallery storage contract shared by every backend.

A *gallery* is a named set of enrolled *subjects* for one recognizer (``model``, embedding size ``dim``).
A subject holds one or more embeddings (one per enrolment image) and a single **template** used for 1:N
search. This module defines:

* the frozen result types :class:`GalleryInfo`, :class:`SubjectInfo`, :class:`SearchHit`;
* the :class:`GalleryStore` protocol: what a backend (SQLite, PostgreSQL) must provide, so callers never
  depend on the backend;
* the change feed (:class:`Change`, :class:`StoreSnapshot`): every mutation commits in the same
  transaction as a change-log row with a monotonic sequence number, so an index loads in full once and
  then applies only what changed after its last sequence number;
* the validation and template math every backend must use, so all backends agree bit for bit;
* the row conversions the SQL backends share (vector packing, subject and change rows), so each backend
  keeps only its SQL and its transaction handling.

Template definition (quality-weighted mean direction)::

    wᵢ = max(qᵢ, TEMPLATE_WEIGHT_FLOOR)            qᵢ = calibrated quality in [0, 1]
    t  = Σᵢ wᵢ·eᵢ / ‖Σᵢ wᵢ·eᵢ‖₂                      over *all* stored embeddings eᵢ of the subject

The floor keeps a subject whose every quality is 0 well-defined (it degrades to the plain mean
direction). If the weighted sum vanishes (embeddings cancel out exactly), the template is the embedding
with the highest weight. ``template_quality`` is ``max(qᵢ)``: the best evidence enrolled so far.
The template is recomputed from every stored embedding on each write to the subject, and stored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from facegate.errors import (
    DimensionMismatchError,
    GalleryError,
    GalleryNotFoundError,
    InvalidParameterError,
    SubjectNotFoundError,
)

#: Gallery and model names: 1–64 characters of ``A–Z a–z 0–9 _ . -``.
GALLERY_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Subject ids: 1–128 characters of ``A–Z a–z 0–9 _ . - @ :`` (so e-mail-like and ``ns:id`` ids fit).
SUBJECT_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.@:-]{1,128}$")
#: Smallest weight a stored embedding gets in its subject's template.
TEMPLATE_WEIGHT_FLOOR = 1e-3
#: Largest embedding dimension a gallery may declare.
MAX_DIM = 8192
#: Tolerance on ‖e‖₂ = 1 for stored embeddings.
NORM_TOLERANCE = 1e-3
#: Largest JSON-encoded ``meta`` per subject, in bytes.
MAX_META_BYTES = 16 * 1024
#: Largest page size of :meth:`GalleryStore.list_subjects`.
MAX_PAGE = 10_000


@dataclass(frozen=True, slots=True)
class GalleryInfo:
    """One gallery.

    Attributes:
        name: the gallery's name (:data:`GALLERY_NAME_PATTERN`).
        model: the recognizer whose embeddings it holds (registry name).
        dim: embedding size D every stored vector has.
        created_at: creation time, Unix seconds (UTC).
        subjects: number of enrolled subjects.
    """

    name: str
    model: str
    dim: int
    created_at: float
    subjects: int

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "model": self.model,
            "dim": self.dim,
            "created_at": self.created_at,
            "subjects": self.subjects,
        }


@dataclass(frozen=True, slots=True)
class SubjectInfo:
    """One enrolled subject.

    Attributes:
        subject_id: the caller's id (:data:`SUBJECT_ID_PATTERN`), unique within its gallery.
        n_embeddings: number of stored embeddings the template is built from.
        template_quality: ``max`` calibrated quality of those embeddings, in ``[0, 1]``.
        meta: caller's JSON object (a fresh copy; mutating it changes nothing stored).
        created_at: first enrolment, Unix seconds.
        updated_at: last write to this subject, Unix seconds.
    """

    subject_id: str
    n_embeddings: int
    template_quality: float
    meta: dict[str, Any] = field(hash=False)
    created_at: float
    updated_at: float

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "subject_id": self.subject_id,
            "n_embeddings": self.n_embeddings,
            "template_quality": round(float(self.template_quality), 5),
            "meta": dict(self.meta),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One candidate of a 1:N search.

    Attributes:
        subject_id: the candidate subject.
        score: cosine similarity of the query and the subject's template, in ``[-1, 1]``.
        match: ``score >= threshold`` for the threshold the search used.
    """

    subject_id: str
    score: float
    match: bool

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {"subject_id": self.subject_id, "score": round(float(self.score), 6), "match": self.match}


#: Change-log operations. A subject change is *state-based*: the feed carries the subject's template as the
#: store holds it when the feed is read (``None`` once the subject is gone), so replaying changes in
#: sequence order always converges on the store's state, and no erased template lives on in the log.
CHANGE_OPS = ("create_gallery", "delete_gallery", "enrol", "delete_subject")


@dataclass(frozen=True, slots=True)
class Change:
    """One change-log entry, as read from the feed.

    Attributes:
        seq: the monotonic sequence number (commit order; gap-free on every backend).
        op: one of :data:`CHANGE_OPS`.
        gallery: the gallery the change is about.
        subject_id: the subject (``None`` for gallery changes).
        committed_at: commit time, Unix seconds (for the feed-lag metric).
        dim: the gallery's dim when it exists at read time, else ``None``.
        template: the subject's current ``(D,) float32`` template at read time, ``None`` when the subject
            (or its gallery) no longer exists.
    """

    seq: int
    op: str
    gallery: str
    subject_id: str | None
    committed_at: float
    dim: int | None = None
    template: np.ndarray | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    """Every gallery's templates as of change ``seq`` (one read transaction).

    Attributes:
        seq: the last change the snapshot includes.
        galleries: ``{name: (dim, subject_ids, (S, D) float32 templates)}``.
    """

    seq: int
    galleries: dict[str, tuple[int, list[str], np.ndarray]] = field(hash=False)


@runtime_checkable
class GalleryStore(Protocol):
    """Durable gallery storage. Every method is thread-safe and each write is one transaction.

    A write returns only once it is durable (it survives a process crash and, as far as the backend's
    fsync guarantees reach, a power loss). Errors are raised as :class:`facegate.errors.GalleryError`
    subclasses (or :class:`~facegate.errors.InvalidParameterError` for malformed arguments); no backend
    exception escapes.
    """

    def create_gallery(self, name: str, model: str, dim: int) -> GalleryInfo:
        """Create an empty gallery. Raises GalleryExistsError / InvalidParameterError."""
        ...

    def list_galleries(self) -> list[GalleryInfo]:
        """All galleries, by name."""
        ...

    def get_gallery(self, name: str) -> GalleryInfo:
        """One gallery. Raises GalleryNotFoundError."""
        ...

    def delete_gallery(self, name: str) -> None:
        """Delete a gallery with all its subjects and embeddings. Raises GalleryNotFoundError."""
        ...

    def add_embeddings(
        self,
        gallery: str,
        subject_id: str,
        embeddings: np.ndarray,
        qualities: np.ndarray,
        meta: dict[str, Any] | None = None,
    ) -> SubjectInfo:
        """Append embeddings to a subject (created if new) and recompute its template.

        Args:
            embeddings: ``(k, D) float32``, each row L2-normalised; ``D`` must equal the gallery's dim.
            qualities: ``(k,) float32`` calibrated qualities in ``[0, 1]``.
            meta: replaces the subject's meta when given; ``None`` keeps it (``{}`` for a new subject).

        Raises:
            GalleryNotFoundError, DimensionMismatchError, InvalidParameterError.
        """
        ...

    def get_subject(self, gallery: str, subject_id: str) -> SubjectInfo:
        """One subject. Raises GalleryNotFoundError / SubjectNotFoundError."""
        ...

    def get_template(self, gallery: str, subject_id: str) -> np.ndarray:
        """A subject's stored template, ``(D,) float32`` unit-norm."""
        ...

    def list_subjects(self, gallery: str, offset: int = 0, limit: int = 100) -> list[SubjectInfo]:
        """A page of subjects ordered by ``subject_id``; ``0 <= offset``, ``1 <= limit <= MAX_PAGE``."""
        ...

    def delete_subject(self, gallery: str, subject_id: str) -> None:
        """Erase a subject and all its embeddings (really removed, not flagged)."""
        ...

    def load_templates(self, gallery: str) -> tuple[list[str], np.ndarray]:
        """Every template of a gallery: ``(subject_ids, (S, D) float32)`` in matching order."""
        ...

    def import_templates(
        self,
        gallery: str,
        subject_ids: list[str],
        templates: np.ndarray,
        qualities: np.ndarray,
    ) -> int:
        """Bulk enrolment without photos: each ``(S, D) float32`` unit-norm row becomes a subject's only
        embedding (replacing what a subject of that id held). One transaction, one change row per subject.
        Returns the number of subjects written."""
        ...

    def current_seq(self) -> int:
        """The sequence number of the last committed change (0 when none). A cheap read."""
        ...

    def changes_since(self, seq: int, limit: int = 10_000) -> list[Change]:
        """Up to ``limit`` changes after ``seq``, in sequence order, read in one snapshot."""
        ...

    def load_snapshot(self) -> StoreSnapshot:
        """Every gallery's templates and the sequence number they are current at (start-up load)."""
        ...

    def wait_for_change(self, after: int, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a change after ``after`` may have committed (PostgreSQL: a
        LISTEN/NOTIFY wake-up; SQLite: polling). Returns whether one did (spurious ``True`` allowed)."""
        ...

    def close(self) -> None:
        """Release the backend's resources; later calls raise GalleryError."""
        ...


# --------------------------------------------------------------------------- validation
def validate_gallery_name(name: object, *, what: str = "gallery name") -> str:
    """Return ``name`` if it matches :data:`GALLERY_NAME_PATTERN`, else raise InvalidParameterError."""
    if not isinstance(name, str) or not GALLERY_NAME_PATTERN.fullmatch(name):
        raise InvalidParameterError(
            f"invalid {what} {name!r}: 1-64 characters of A-Z a-z 0-9 _ . -",
            detail={"field": what, "pattern": GALLERY_NAME_PATTERN.pattern},
        )
    return name


def validate_subject_id(subject_id: object) -> str:
    """Return ``subject_id`` if it matches :data:`SUBJECT_ID_PATTERN`, else raise InvalidParameterError."""
    if not isinstance(subject_id, str) or not SUBJECT_ID_PATTERN.fullmatch(subject_id):
        raise InvalidParameterError(
            f"invalid subject id {subject_id!r}: 1-128 characters of A-Z a-z 0-9 _ . - @ :",
            detail={"field": "subject_id", "pattern": SUBJECT_ID_PATTERN.pattern},
        )
    return subject_id


def validate_dim(dim: object) -> int:
    """Return ``dim`` as int if it is an integer in ``[1, MAX_DIM]``."""
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or not 1 <= int(dim) <= MAX_DIM:
        raise InvalidParameterError(f"invalid dim {dim!r}: an integer in [1, {MAX_DIM}]", detail={"field": "dim"})
    return int(dim)


def validate_page(offset: object, limit: object) -> tuple[int, int]:
    """Check a page request: ``offset >= 0`` and ``1 <= limit <= MAX_PAGE``."""
    ok_offset = isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0
    ok_limit = isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit <= MAX_PAGE
    if not (ok_offset and ok_limit):
        raise InvalidParameterError(
            f"invalid page offset={offset!r} limit={limit!r}: offset >= 0, 1 <= limit <= {MAX_PAGE}",
            detail={"field": "offset/limit"},
        )
    return int(offset), int(limit)  # type: ignore[arg-type]


def encode_meta(meta: dict[str, Any] | None) -> str | None:
    """JSON text of ``meta`` (``None`` passes through); raises InvalidParameterError if not a JSON object."""
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
    """Check and normalise the dtype/layout of an enrolment batch.

    Args:
        embeddings: ``(k, D)``, finite, each row of unit L2 norm (±:data:`NORM_TOLERANCE`), ``k >= 1``.
        qualities: ``(k,)`` finite values in ``[0, 1]``.
        dim: the gallery's D.

    Returns:
        ``(k, D) float32`` C-contiguous embeddings and ``(k,) float32`` qualities.

    Raises:
        DimensionMismatchError: ``D != dim``.
        InvalidParameterError: anything else malformed.
    """
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
            f"qualities must be a ({emb.shape[0]},) numeric array, got shape {q.shape}",
            detail={"field": "qualities"},
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


def validate_import(subject_ids: object, templates: object, qualities: object) -> list[str]:
    """Check the ids of a template import: valid, unique, one per row of ``templates``."""
    if not isinstance(subject_ids, list | tuple) or not subject_ids:
        raise InvalidParameterError("subject_ids must be a non-empty list", detail={"field": "subject_ids"})
    ids = [validate_subject_id(s) for s in subject_ids]
    if len(set(ids)) != len(ids):
        raise InvalidParameterError("subject_ids must be unique within one import", detail={"field": "subject_ids"})
    rows = getattr(templates, "shape", (None,))[0]
    if rows != len(ids) or getattr(qualities, "shape", (None,))[0] != len(ids):
        raise InvalidParameterError(
            f"{len(ids)} subject ids need as many template rows and qualities",
            detail={"field": "templates", "ids": len(ids), "rows": rows},
        )
    return ids


# --------------------------------------------------------------------------- template math
def quality_weighted_template(embeddings: np.ndarray, qualities: np.ndarray) -> np.ndarray:
    """The subject template: ``normalise(Σ max(qᵢ, floor)·eᵢ)`` (see the module docstring).

    Args:
        embeddings: ``(n, D)`` float32, unit-norm rows, ``n >= 1``.
        qualities: ``(n,)`` float32 in ``[0, 1]``.

    Returns:
        ``(D,) float32`` unit-norm template (computed in float64, then rounded once).
    """
    e = np.asarray(embeddings, dtype=np.float64)
    w = np.maximum(np.asarray(qualities, dtype=np.float64), TEMPLATE_WEIGHT_FLOOR)
    s = w @ e
    norm = float(np.linalg.norm(s))
    if not math.isfinite(norm) or norm < 1e-12:
        s = e[int(np.argmax(w))]
        norm = float(np.linalg.norm(s))
    return (s / norm).astype(np.float32)


def template_quality(qualities: np.ndarray) -> float:
    """``max(qᵢ)`` of a subject's stored qualities (``(n,)`` float32)."""
    return float(np.max(np.asarray(qualities, dtype=np.float32)))


def decode_meta(text: str | None) -> dict[str, Any]:
    """Inverse of :func:`encode_meta` for stored text (``None``/empty → ``{}``)."""
    if not text:
        return {}
    value = json.loads(text)
    return value if isinstance(value, dict) else {}


# --------------------------------------------------------------------------- shared by the SQL backends
def validate_new_gallery(name: object, model: object, dim: object) -> int:
    """Check the arguments of :meth:`GalleryStore.create_gallery`; returns ``dim`` as int."""
    validate_gallery_name(name)
    validate_gallery_name(model, what="model name")
    return validate_dim(dim)


def validate_subject_ref(gallery: object, subject_id: object) -> None:
    """Check a ``(gallery, subject_id)`` pair an operation on one subject names."""
    validate_gallery_name(gallery)
    validate_subject_id(subject_id)


def pack_vector(vec: np.ndarray) -> bytes:
    """Raw little-endian float32 bytes of a vector (how the SQL backends store embeddings and templates)."""
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()


def unpack_vector(blob: bytes | bytearray | memoryview, dim: int) -> np.ndarray:
    """``(dim,) float32`` from bytes written by :func:`pack_vector`; raises GalleryError on a wrong length."""
    if len(blob) != 4 * dim:
        raise GalleryError(
            f"corrupt vector in the gallery database: {len(blob)} bytes, expected {4 * dim}",
            detail={"bytes": len(blob), "dim": dim},
        )
    return np.frombuffer(bytes(blob), dtype="<f4").astype(np.float32)


def read_templates(cur: Any, dim: int, gallery: str, chunk: int = 65_536) -> tuple[list[str], np.ndarray]:
    """``(subject_ids, (S, D) float32)`` from a cursor over ``(subject_id, template bytes)`` rows, fetched
    ``chunk`` rows at a time: a 1M-subject load holds one chunk's bytes, never all of them twice."""
    ids: list[str] = []
    parts = [np.zeros((0, dim), np.float32)]
    while rows := cur.fetchmany(chunk):
        blob = b"".join([r[1] for r in rows])
        if len(blob) != 4 * dim * len(rows):
            raise GalleryError(f"corrupt template in gallery {gallery!r}", detail={"gallery": gallery})
        ids += [str(r[0]) for r in rows]
        parts.append(np.frombuffer(blob, "<f4").reshape(len(rows), dim))
    return ids, np.concatenate(parts).astype(np.float32, copy=False)


def rebuild_template(stored: list[tuple[Any, Any]], dim: int) -> tuple[bytes, float]:
    """A subject's packed template and its quality from all its stored ``(vector bytes, quality)`` rows."""
    all_e = np.stack([unpack_vector(v, dim) for v, _ in stored])
    all_q = np.asarray([qq for _, qq in stored], dtype=np.float32)
    return pack_vector(quality_weighted_template(all_e, all_q)), template_quality(all_q)


#: Columns, in order, that :func:`subject_info_from_row` reads.
SUBJECT_COLS = "subject_id, n_embeddings, template_quality, meta, created_at, updated_at"


def subject_info_from_row(row: tuple[Any, ...]) -> SubjectInfo:
    """A :class:`SubjectInfo` from a row of :data:`SUBJECT_COLS`."""
    sid, n, tq, meta, created, updated = row
    return SubjectInfo(
        subject_id=str(sid),
        n_embeddings=int(n),
        template_quality=float(tq),
        meta=decode_meta(meta),
        created_at=float(created),
        updated_at=float(updated),
    )


def gallery_from_row(row: tuple[Any, ...] | None, name: str) -> tuple[int, str, int, float]:
    """``(id, model, dim, created_at)`` of a gallery's row; raises GalleryNotFoundError when it is ``None``."""
    if row is None:
        raise GalleryNotFoundError(f"no gallery named {name!r}", detail={"gallery": name})
    return int(row[0]), str(row[1]), int(row[2]), float(row[3])


def subject_not_found(gallery: str, subject_id: str) -> SubjectNotFoundError:
    """The error for a subject a gallery does not hold."""
    return SubjectNotFoundError(
        f"no subject {subject_id!r} in gallery {gallery!r}", detail={"gallery": gallery, "subject_id": subject_id}
    )


def changes_from_rows(rows: list[tuple[Any, ...]]) -> list[Change]:
    """Feed entries from ``(seq, op, gallery, subject_id, committed_at, dim, template bytes)`` rows, where
    ``dim`` and the template are ``NULL`` once the gallery or subject is gone."""
    out = []
    for sq, op, gal, sid, at, dim, blob in rows:
        tpl = unpack_vector(blob, int(dim)) if blob is not None and dim is not None else None
        out.append(Change(int(sq), str(op), str(gal), sid, float(at), None if dim is None else int(dim), tpl))
    return out


def gallery_infos(rows: list[tuple[Any, ...]]) -> list[GalleryInfo]:
    """:class:`GalleryInfo` from ``(name, model, dim, created_at, subjects)`` rows."""
    return [GalleryInfo(str(n), str(m), int(d), float(c), int(s)) for n, m, d, c, s in rows]
