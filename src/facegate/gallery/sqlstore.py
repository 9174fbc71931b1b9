"""The part of a SQL gallery backend that does not depend on the database.

:class:`SQLGalleryStore` implements the :class:`~facegate.gallery.base.GalleryStore` calls whose logic is
the same on every SQL backend (validation, the order of reads and writes inside one transaction, building
the results) once. A backend subclasses it and supplies its SQL text as the ``_SQL_*`` class attributes
(each in the backend's placeholder style, with the parameters in the order given here), its transaction
handling (:meth:`_tx`) and the few steps its driver does differently (inserting rows, reading templates,
numbering changes, erasing deleted data). Both ``sqlite3`` and psycopg connections offer
``execute(sql, params)`` returning a cursor with ``fetchone``/``fetchall``/``rowcount``, which is all this
class uses.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Self

import numpy as np

from facegate.errors import GalleryExistsError
from facegate.gallery.base import (
    Change,
    GalleryInfo,
    StoreSnapshot,
    SubjectInfo,
    changes_from_rows,
    encode_meta,
    gallery_from_row,
    gallery_infos,
    pack_vector,
    rebuild_template,
    subject_info_from_row,
    subject_not_found,
    unpack_vector,
    validate_embeddings,
    validate_gallery_name,
    validate_import,
    validate_new_gallery,
    validate_page,
    validate_subject_ref,
)

#: One change-log row as the backends write it: ``(op, gallery, subject_id)``.
ChangeRow = tuple[str, str, str | None]


class SQLGalleryStore:
    """Shared gallery calls of the SQL backends (see the module docstring)."""

    #: ``(name)`` → any row when a gallery of that name exists.
    _SQL_GALLERY_EXISTS: ClassVar[str]
    #: ``(name, model, dim, created_at)``.
    _SQL_INSERT_GALLERY: ClassVar[str]
    #: ``(name)`` → ``(id, model, dim, created_at)``.
    _SQL_GALLERY_ROW: ClassVar[str]
    #: → ``(name, model, dim, created_at, subjects)`` rows, by name.
    _SQL_LIST_GALLERIES: ClassVar[str]
    #: → ``(id, name, dim)`` rows, by name.
    _SQL_GALLERY_IDS: ClassVar[str]
    #: ``(gallery_id)`` → ``(count)``.
    _SQL_COUNT_SUBJECTS: ClassVar[str]
    #: ``(gallery_id)``.
    _SQL_DELETE_GALLERY: ClassVar[str]
    #: ``(gallery_id, subject_id)`` → ``(id)``.
    _SQL_SUBJECT_PK: ClassVar[str]
    #: ``(meta, id)``.
    _SQL_SET_META: ClassVar[str]
    #: ``(subject_pk)`` → ``(vector, quality)`` rows in insertion order.
    _SQL_STORED_EMBEDDINGS: ClassVar[str]
    #: ``(template, template_quality, n_embeddings, updated_at, id)``.
    _SQL_SET_TEMPLATE: ClassVar[str]
    #: ``(id)`` → a row of :data:`~facegate.gallery.base.SUBJECT_COLS`.
    _SQL_SUBJECT_BY_PK: ClassVar[str]
    #: ``(gallery_id, subject_id)`` → a row of :data:`~facegate.gallery.base.SUBJECT_COLS`.
    _SQL_SUBJECT: ClassVar[str]
    #: ``(gallery_id, subject_id)`` → ``(template)``.
    _SQL_TEMPLATE: ClassVar[str]
    #: ``(gallery_id, limit, offset)`` → rows of :data:`~facegate.gallery.base.SUBJECT_COLS` by subject id.
    _SQL_SUBJECT_PAGE: ClassVar[str]
    #: ``(gallery_id, subject_id)``; its cursor's ``rowcount`` says whether a subject was deleted.
    _SQL_DELETE_SUBJECT: ClassVar[str]
    #: → ``(max seq or 0)``.
    _SQL_CURRENT_SEQ: ClassVar[str]
    #: ``(after, limit)`` → rows for :func:`~facegate.gallery.base.changes_from_rows`.
    _SQL_CHANGES: ClassVar[str]

    # ------------------------------------------------------------------ backend steps
    def _tx(self, what: str, *, write: bool, snapshot: bool = False) -> AbstractContextManager[Any]:
        """One transaction (``write``: serialised with every other writer; ``snapshot``: every read in it
        sees one snapshot); the driver's errors become GalleryError naming ``what``."""
        raise NotImplementedError

    def _log(self, conn: Any, rows: list[ChangeRow], now: float) -> None:
        """Append change rows inside the caller's write transaction."""
        raise NotImplementedError

    def _insert_subject(self, conn: Any, gid: int, subject_id: str, meta_text: str, now: float) -> int:
        """Insert an empty subject row (no embeddings yet); returns its primary key."""
        raise NotImplementedError

    def _insert_embeddings(self, conn: Any, rows: list[tuple[int, bytes, float, float]]) -> None:
        """Insert ``(subject_pk, vector, quality, created_at)`` embedding rows."""
        raise NotImplementedError

    def _write_imported(self, conn: Any, gid: int, ids: list[str], emb: np.ndarray, q: np.ndarray, now: float) -> None:
        """Replace subjects ``ids`` with single-embedding subjects of the ``(S, D) float32`` rows ``emb``
        and ``(S,)`` qualities ``q`` (the change rows are the caller's)."""
        raise NotImplementedError

    def _templates(
        self, conn: Any, gid: int, dim: int, gallery: str, ordered: bool = True
    ) -> tuple[list[str], np.ndarray]:
        """``(subject_ids, (S, D) float32)`` of one gallery; ``ordered``: by subject id (byte order)."""
        raise NotImplementedError

    def _erase_deleted(self) -> None:
        """After a committed delete: make the backend drop the deleted bytes (as far as it can)."""
        raise NotImplementedError

    def _gallery_row(self, conn: Any, name: str) -> tuple[int, str, int, float]:
        """``(id, model, dim, created_at)`` of a gallery; raises GalleryNotFoundError."""
        return gallery_from_row(conn.execute(self._SQL_GALLERY_ROW, (name,)).fetchone(), name)

    # ------------------------------------------------------------------ galleries
    def create_gallery(self, name: str, model: str, dim: int) -> GalleryInfo:
        """Create an empty gallery; raises GalleryExistsError / InvalidParameterError."""
        dim = validate_new_gallery(name, model, dim)
        now = time.time()
        with self._tx(f"creating gallery {name!r}", write=True) as conn:
            if conn.execute(self._SQL_GALLERY_EXISTS, (name,)).fetchone():
                raise GalleryExistsError(f"gallery {name!r} already exists", detail={"gallery": name})
            conn.execute(self._SQL_INSERT_GALLERY, (name, model, dim, now))
            self._log(conn, [("create_gallery", name, None)], now)
        return GalleryInfo(name=name, model=model, dim=dim, created_at=now, subjects=0)

    def list_galleries(self) -> list[GalleryInfo]:
        """All galleries, ordered by name."""
        with self._tx("listing galleries", write=False) as conn:
            rows = conn.execute(self._SQL_LIST_GALLERIES).fetchall()
        return gallery_infos(rows)

    def get_gallery(self, name: str) -> GalleryInfo:
        """One gallery; raises GalleryNotFoundError."""
        validate_gallery_name(name)
        with self._tx(f"reading gallery {name!r}", write=False) as conn:
            gid, model, dim, created = self._gallery_row(conn, name)
            n = conn.execute(self._SQL_COUNT_SUBJECTS, (gid,)).fetchone()[0]
        return GalleryInfo(name=name, model=model, dim=dim, created_at=created, subjects=int(n))

    def delete_gallery(self, name: str) -> None:
        """Delete a gallery, its subjects and their embeddings; raises GalleryNotFoundError."""
        validate_gallery_name(name)
        with self._tx(f"deleting gallery {name!r}", write=True) as conn:
            gid = self._gallery_row(conn, name)[0]
            conn.execute(self._SQL_DELETE_GALLERY, (gid,))
            self._log(conn, [("delete_gallery", name, None)], time.time())
        self._erase_deleted()

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

        ``meta`` replaces the stored meta when not ``None``. One write transaction.
        """
        validate_subject_ref(gallery, subject_id)
        meta_text = encode_meta(meta)
        with self._tx(f"enrolling {subject_id!r} in {gallery!r}", write=True) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            emb, q = validate_embeddings(embeddings, qualities, dim)
            now = time.time()
            row = conn.execute(self._SQL_SUBJECT_PK, (gid, subject_id)).fetchone()
            if row is None:
                spk = self._insert_subject(conn, gid, subject_id, meta_text or "{}", now)
            else:
                spk = int(row[0])
                if meta_text is not None:
                    conn.execute(self._SQL_SET_META, (meta_text, spk))
            self._insert_embeddings(conn, [(spk, pack_vector(e), float(qi), now) for e, qi in zip(emb, q, strict=True)])
            stored = conn.execute(self._SQL_STORED_EMBEDDINGS, (spk,)).fetchall()
            template, quality = rebuild_template(stored, dim)
            conn.execute(self._SQL_SET_TEMPLATE, (template, quality, len(stored), now, spk))
            self._log(conn, [("enrol", gallery, subject_id)], now)
            out = conn.execute(self._SQL_SUBJECT_BY_PK, (spk,)).fetchone()
        return subject_info_from_row(out)

    def get_subject(self, gallery: str, subject_id: str) -> SubjectInfo:
        """One subject; raises GalleryNotFoundError / SubjectNotFoundError."""
        validate_subject_ref(gallery, subject_id)
        with self._tx(f"reading {subject_id!r} in {gallery!r}", write=False) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            row = conn.execute(self._SQL_SUBJECT, (gid, subject_id)).fetchone()
        if row is None:
            raise subject_not_found(gallery, subject_id)
        return subject_info_from_row(row)

    def get_template(self, gallery: str, subject_id: str) -> np.ndarray:
        """A subject's stored ``(D,) float32`` template."""
        validate_subject_ref(gallery, subject_id)
        with self._tx(f"reading template of {subject_id!r}", write=False) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            row = conn.execute(self._SQL_TEMPLATE, (gid, subject_id)).fetchone()
        if row is None:
            raise subject_not_found(gallery, subject_id)
        return unpack_vector(row[0], dim)

    def list_subjects(self, gallery: str, offset: int = 0, limit: int = 100) -> list[SubjectInfo]:
        """A page of subjects ordered by ``subject_id``."""
        validate_gallery_name(gallery)
        offset, limit = validate_page(offset, limit)
        with self._tx(f"listing subjects of {gallery!r}", write=False) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            rows = conn.execute(self._SQL_SUBJECT_PAGE, (gid, limit, offset)).fetchall()
        return [subject_info_from_row(r) for r in rows]

    def delete_subject(self, gallery: str, subject_id: str) -> None:
        """Erase a subject and (by cascade) all its embedding rows, then the backend's erasure step."""
        validate_subject_ref(gallery, subject_id)
        with self._tx(f"deleting {subject_id!r} from {gallery!r}", write=True) as conn:
            gid = self._gallery_row(conn, gallery)[0]
            if conn.execute(self._SQL_DELETE_SUBJECT, (gid, subject_id)).rowcount == 0:
                raise subject_not_found(gallery, subject_id)
            self._log(conn, [("delete_subject", gallery, subject_id)], time.time())
        self._erase_deleted()

    def load_templates(self, gallery: str) -> tuple[list[str], np.ndarray]:
        """``(subject_ids, (S, D) float32 templates)`` of a gallery, ordered by ``subject_id``."""
        validate_gallery_name(gallery)
        with self._tx(f"loading templates of {gallery!r}", write=False) as conn:
            gid, _, dim, _ = self._gallery_row(conn, gallery)
            return self._templates(conn, gid, dim, gallery)

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
            self._write_imported(conn, gid, ids, emb, q, now)
            self._log(conn, [("enrol", gallery, sid) for sid in ids], now)
        return len(ids)

    # ------------------------------------------------------------------ change feed
    def current_seq(self) -> int:
        """The last committed change's sequence number (0 when none)."""
        with self._tx("reading the change sequence", write=False) as conn:
            return int(conn.execute(self._SQL_CURRENT_SEQ).fetchone()[0])

    def changes_since(self, seq: int, limit: int = 10_000) -> list[Change]:
        """Up to ``limit`` changes after ``seq`` with the current state they refer to (one snapshot)."""
        with self._tx("reading the change feed", write=False, snapshot=True) as conn:
            rows = conn.execute(self._SQL_CHANGES, (int(seq), int(limit))).fetchall()
        return changes_from_rows(rows)

    def load_snapshot(self) -> StoreSnapshot:
        """Every gallery's templates and the sequence number they are current at (one snapshot)."""
        galleries: dict[str, tuple[int, list[str], np.ndarray]] = {}
        with self._tx("loading every gallery", write=False, snapshot=True) as conn:
            seq = int(conn.execute(self._SQL_CURRENT_SEQ).fetchone()[0])
            for gid, name, dim in conn.execute(self._SQL_GALLERY_IDS).fetchall():
                galleries[str(name)] = (int(dim), *self._templates(conn, int(gid), int(dim), str(name), False))
        return StoreSnapshot(seq=seq, galleries=galleries)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the backend's resources; later calls raise GalleryError."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ChangeRow", "SQLGalleryStore"]
