"""The gallery service: a durable store and an on-device search index that never disagree.

Writes are *write-through* under one lock per gallery: the store (the source of truth) commits first,
then the index is updated from what the store holds. If the index update fails after the commit, that
gallery is rebuilt from the store; if even that fails the gallery is dropped from the index and is
reloaded from the store on its next use. So a search never answers from an index that differs from an
acknowledged database state, and a failed store write leaves the index untouched.

Searches take no gallery lock (the index has its own per-gallery lock that makes each update atomic
for readers). The service knows nothing about HTTP or models: callers pass embeddings, and must check
that :attr:`GalleryInfo.model` is the recognizer that produced them (the store only checks ``dim``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from facegate.errors import GalleryNotFoundError, InvalidParameterError
from facegate.gallery.base import (
    GalleryInfo,
    GalleryStore,
    SearchHit,
    SubjectInfo,
    validate_gallery_name,
)
from facegate.gallery.index import GalleryIndex

log = logging.getLogger(__name__)

#: Called with ``{gallery: number of subjects}`` after start-up and after every successful write.
StatsHook = Callable[[dict[str, int]], None]


def _check_threshold(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not -1.0 <= float(value) <= 1.0:
        raise InvalidParameterError(
            f"match threshold must be a cosine similarity in [-1, 1], got {value!r}",
            detail={"field": "threshold"},
        )
    if math.isnan(float(value)):
        raise InvalidParameterError("match threshold is NaN", detail={"field": "threshold"})
    return float(value)


class Gallery:
    """Durable 1:N gallery with exact on-device search.

    Args:
        store: the durable backend (e.g. :class:`~facegate.gallery.sqlite.SQLiteGalleryStore`).
        index: the search index; it is (re)loaded from ``store`` here.
        match_threshold: default cosine threshold for :attr:`SearchHit.match` (``score >= threshold``).
        stats_hook: optional callable receiving ``{gallery: size}`` after start-up and every write; calls
            are serialised (never concurrent); its exceptions are logged, not raised.
    """

    def __init__(
        self,
        store: GalleryStore,
        index: GalleryIndex,
        *,
        match_threshold: float,
        stats_hook: StatsHook | None = None,
    ) -> None:
        self._store = store
        self._index = index
        self._threshold = _check_threshold(match_threshold)
        self._stats_hook = stats_hook
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._stats_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._version = self._store_version()
        self._index.rebuild(store)
        self._emit_stats()

    def _store_version(self) -> int | None:
        """The store's optional ``data_version()`` (SQLite's; changes on other processes' commits), or None."""
        fn = getattr(self._store, "data_version", None)
        return None if fn is None else fn()

    def sync(self) -> bool:
        """Rebuild the index if another process committed to the store since the last look (several
        front-end processes share one SQLite file; each holds its own index). Returns whether it rebuilt."""
        version = self._store_version()
        if version is None or version == self._version:
            return False
        with self._sync_lock:
            version = self._store_version()
            if version == self._version:
                return False
            log.info("gallery store changed in another process: rebuilding the index")
            self._index.rebuild(self._store)
            self._version = version
        self._emit_stats()
        return True

    # ------------------------------------------------------------------ plumbing
    @property
    def match_threshold(self) -> float:
        """The default match threshold."""
        return self._threshold

    @property
    def store(self) -> GalleryStore:
        """The durable backend."""
        return self._store

    @property
    def index(self) -> GalleryIndex:
        """The search index."""
        return self._index

    def set_stats_hook(self, hook: StatsHook | None) -> None:
        """Install (or remove) the stats hook and call it once with the current sizes."""
        self._stats_hook = hook
        self._emit_stats()

    def _lock_for(self, gallery: str) -> threading.Lock:
        validate_gallery_name(gallery)  # never grow the lock table for junk names
        with self._locks_guard:
            lock = self._locks.get(gallery)
            if lock is None:
                lock = self._locks[gallery] = threading.Lock()
            return lock

    def _emit_stats(self) -> None:
        """Call the hook, serialised; sizes are read under the same lock, so the last call is the newest."""
        with self._stats_lock:
            hook = self._stats_hook
            if hook is None:
                return
            try:
                hook(self._index.sizes())
            except Exception:
                log.exception("gallery stats hook failed")

    def _apply_to_index(self, gallery: str, update: Callable[[], object]) -> None:
        """Run an index update after a committed store write; on failure, resync from the store.

        Must be called with the gallery's lock held.
        """
        try:
            update()
        except Exception:
            log.exception("index update of gallery %r failed after the database write; rebuilding it", gallery)
            try:
                self._index.rebuild_gallery(self._store, gallery)
            except GalleryNotFoundError:
                self._index.drop(gallery)
            except Exception:
                log.exception("rebuilding gallery %r failed; dropped from the index until next use", gallery)
                self._index.drop(gallery)

    def _recover(self, gallery: str) -> None:
        """Load a gallery the index lacks (dropped after a failure); GalleryNotFoundError if unknown."""
        with self._lock_for(gallery):
            if not self._index.has(gallery):
                self._index.rebuild_gallery(self._store, gallery)
                log.warning("gallery %r was missing from the index; reloaded from the database", gallery)

    # ------------------------------------------------------------------ galleries
    def create_gallery(self, name: str, model: str, dim: int) -> GalleryInfo:
        """Create an empty gallery for ``model`` embeddings of size ``dim``."""
        with self._lock_for(name):
            info = self._store.create_gallery(name, model, dim)
            self._apply_to_index(name, lambda: self._index.ensure_gallery(name, info.dim))
        self._emit_stats()
        return info

    def list_galleries(self) -> list[GalleryInfo]:
        """All galleries, by name."""
        return self._store.list_galleries()

    def get_gallery(self, name: str) -> GalleryInfo:
        """One gallery; raises GalleryNotFoundError."""
        return self._store.get_gallery(name)

    def delete_gallery(self, name: str) -> None:
        """Delete a gallery and everything in it, from the store and the index."""
        with self._lock_for(name):
            self._store.delete_gallery(name)
            self._index.drop(name)
        self._emit_stats()

    # ------------------------------------------------------------------ subjects
    def enrol(
        self,
        gallery: str,
        subject_id: str,
        embeddings: np.ndarray,
        qualities: np.ndarray,
        meta: dict[str, Any] | None = None,
    ) -> SubjectInfo:
        """Add ``(k, D) float32`` unit-norm embeddings with ``(k,)`` calibrated qualities to a subject.

        The subject is created if new; its quality-weighted template is recomputed from all its stored
        embeddings and pushed to the index. ``meta`` replaces the stored meta when given.
        """
        with self._lock_for(gallery):
            info = self._store.add_embeddings(gallery, subject_id, embeddings, qualities, meta)
            self._apply_to_index(
                gallery,
                lambda: self._index.upsert(gallery, subject_id, self._store.get_template(gallery, subject_id)),
            )
        self._emit_stats()
        return info

    def get_subject(self, gallery: str, subject_id: str) -> SubjectInfo:
        """One subject."""
        return self._store.get_subject(gallery, subject_id)

    def list_subjects(self, gallery: str, offset: int = 0, limit: int = 100) -> list[SubjectInfo]:
        """A page of subjects ordered by id."""
        return self._store.list_subjects(gallery, offset, limit)

    def delete_subject(self, gallery: str, subject_id: str) -> None:
        """Erase a subject and its embeddings from the store, then from the index."""

        def _remove() -> None:
            if not self._index.remove(gallery, subject_id):
                raise RuntimeError(f"subject {subject_id!r} was not in the index of {gallery!r}")

        with self._lock_for(gallery):
            self._store.delete_subject(gallery, subject_id)
            self._apply_to_index(gallery, _remove)
        self._emit_stats()

    # ------------------------------------------------------------------ search
    def search(
        self, gallery: str, queries: np.ndarray, k: int = 1, threshold: float | None = None
    ) -> list[list[SearchHit]]:
        """Exact cosine top-``k`` of ``(Q, D) float32`` queries; ``Q`` lists sorted by descending score.

        ``threshold`` overrides the default match threshold for this call.
        """
        thr = self._threshold if threshold is None else _check_threshold(threshold)
        validate_gallery_name(gallery)
        self.sync()
        try:
            return self._index.search(gallery, queries, k, thr)
        except GalleryNotFoundError:
            self._recover(gallery)  # raises the store's GalleryNotFoundError if the gallery does not exist
        return self._index.search(gallery, queries, k, thr)

    def sizes(self) -> dict[str, int]:
        """``{gallery: number of subjects}`` as the index holds them."""
        return self._index.sizes()

    def close(self) -> None:
        """Close the store (the index is plain memory)."""
        self._store.close()
