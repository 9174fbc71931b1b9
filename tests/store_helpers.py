"""Enrolling one subject and reading a gallery store's or index's templates back, for the store, index, service and
enrolment tests (pyproject.toml puts ``tests/`` on the path)."""

from __future__ import annotations

import numpy as np

from facegate.gallery.base import GalleryStore, SubjectInfo
from facegate.gallery.index import GalleryIndex


def add_embeddings(
    store: GalleryStore,
    gallery: str,
    subject_id: str,
    embeddings: np.ndarray,
    qualities: np.ndarray,
    meta: dict | None = None,
) -> SubjectInfo:
    """Append ``(k, D)`` embeddings and ``(k,)`` qualities to one subject, as the enrol route writes it."""
    return store.enrol_many(gallery, [(subject_id, embeddings, qualities, meta)])[0]


def stored_templates(store: GalleryStore, gallery: str) -> tuple[list[str], np.ndarray]:
    """``(subject_ids, (S, D) float32)`` of ``gallery`` as stored (the start-up load), by subject id."""
    _, ids, templates = store.load_snapshot()[1][gallery]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return [ids[i] for i in order], templates[order]


def stored_template(store: GalleryStore, gallery: str, subject_id: str) -> np.ndarray:
    """A subject's stored ``(D,) float32`` template."""
    ids, templates = stored_templates(store, gallery)
    return templates[ids.index(subject_id)]


def index_templates(index: GalleryIndex, gallery: str) -> tuple[list[str], np.ndarray]:
    """``(subject_ids, (S, D) float32)`` that ``index`` holds for ``gallery``, by subject id, read back through
    search: the scores of the D unit queries are the templates' columns (exact: one product by 1 each)."""
    entry = index.entry(gallery)
    assert entry is not None, gallery
    hits, n = index.search_raw(gallery, np.eye(entry.dim, dtype=np.float32), max(1, index.sizes()[gallery]))
    ids = sorted(hits[0][0])
    row = {sid: i for i, sid in enumerate(ids)}
    templates = np.zeros((n, entry.dim), np.float32)
    for j, (names, scores) in enumerate(hits):
        templates[[row[s] for s in names], j] = scores
    return ids, templates
