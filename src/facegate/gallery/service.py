"""The gallery service: a store of record with a change feed, and a search index that follows it.

Every write goes to the store (the truth), which commits it with a change-log row; the index then
applies the feed up to the store's current sequence number (:class:`~facegate.gallery.feed.IndexFollower`).
A search first catches the index up to the store's current sequence number (a cheap ``max(seq)``), so a
write acknowledged by any process sharing the store is visible to every later search: read your writes
across front-ends, engines and hosts. The index is never rebuilt after start-up.

The service knows nothing about HTTP or models: callers pass embeddings, and must check that
:attr:`GalleryInfo.model` is the recognizer that produced them (the store only checks ``dim``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from facegate.errors import InvalidParameterError
from facegate.gallery.base import (
    GalleryInfo,
    GalleryStore,
    SearchHit,
    SubjectInfo,
    validate_gallery_name,
)
from facegate.gallery.feed import IndexFollower, LagHook
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
    """Durable 1:N gallery with exact search, current with the store at every search.

    Args:
        store: the store of record (:func:`facegate.gallery.open_store`).
        index: the search index; it is loaded from ``store`` here, once.
        match_threshold: default cosine threshold for :attr:`SearchHit.match` (``score >= threshold``).
        stats_hook: optional callable receiving ``{gallery: size}`` after start-up and every write; calls
            are serialised (never concurrent); its exceptions are logged, not raised.
        lag_hook: optional callable receiving ``(seconds from commit to index, changes)`` per applied batch.
        follow: also apply foreign changes in a background thread as the store signals them.
    """

    def __init__(
        self,
        store: GalleryStore,
        index: GalleryIndex,
        *,
        match_threshold: float,
        stats_hook: StatsHook | None = None,
        lag_hook: LagHook | None = None,
        follow: bool = False,
    ) -> None:
        self._store = store
        self._index = index
        self._threshold = _check_threshold(match_threshold)
        self._stats_hook = stats_hook
        self._stats_lock = threading.Lock()
        self._follower = IndexFollower(store, index, lag_hook=lag_hook, on_applied=self._emit_stats)
        self._follower.load()
        if follow:
            self._follower.start()
        self._emit_stats()

    def sync(self) -> int:
        """Apply every change committed since the index's last one; returns how many."""
        n = self._follower.catch_up(self._store.current_seq())
        if n:
            self._emit_stats()
        return n

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

    @property
    def follower(self) -> IndexFollower:
        """What keeps the index current."""
        return self._follower

    def set_stats_hook(self, hook: StatsHook | None) -> None:
        """Install (or remove) the stats hook and call it once with the current sizes."""
        self._stats_hook = hook
        self._emit_stats()

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

    def _written(self) -> None:
        """After a committed write: bring the index up to it (and whatever committed before it).

        The write is durable and is acknowledged even if the index cannot apply it now: the change stays
        in the feed and the next search applies it first (or fails, rather than answer without it)."""
        try:
            if self._follower.catch_up():
                return  # the follower reported the new sizes
        except Exception as exc:
            log.warning("gallery index: a committed change is not applied yet (%s); the next search applies it", exc)
        self._emit_stats()

    # ------------------------------------------------------------------ galleries
    def create_gallery(self, name: str, model: str, dim: int) -> GalleryInfo:
        """Create an empty gallery for ``model`` embeddings of size ``dim``."""
        info = self._store.create_gallery(name, model, dim)
        self._written()
        return info

    def list_galleries(self) -> list[GalleryInfo]:
        """All galleries, by name."""
        return self._store.list_galleries()

    def get_gallery(self, name: str) -> GalleryInfo:
        """One gallery; raises GalleryNotFoundError."""
        return self._store.get_gallery(name)

    def delete_gallery(self, name: str) -> None:
        """Delete a gallery and everything in it, from the store and the index."""
        self._store.delete_gallery(name)
        self._written()

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
        embeddings. ``meta`` replaces the stored meta when given.
        """
        info = self._store.add_embeddings(gallery, subject_id, embeddings, qualities, meta)
        self._written()
        return info

    def import_templates(
        self, gallery: str, subject_ids: list[str], templates: np.ndarray, qualities: np.ndarray | None = None
    ) -> int:
        """Bulk-enrol ``(S, D) float32`` unit-norm templates (qualities default to 1). Returns S."""
        q = np.ones(len(subject_ids), np.float32) if qualities is None else qualities
        n = self._store.import_templates(gallery, list(subject_ids), templates, q)
        self._written()
        return n

    def get_subject(self, gallery: str, subject_id: str) -> SubjectInfo:
        """One subject."""
        return self._store.get_subject(gallery, subject_id)

    def list_subjects(self, gallery: str, offset: int = 0, limit: int = 100) -> list[SubjectInfo]:
        """A page of subjects ordered by id."""
        return self._store.list_subjects(gallery, offset, limit)

    def delete_subject(self, gallery: str, subject_id: str) -> None:
        """Erase a subject and its embeddings from the store, then from the index."""
        self._store.delete_subject(gallery, subject_id)
        self._written()

    # ------------------------------------------------------------------ search
    def search(
        self, gallery: str, queries: np.ndarray, k: int = 1, threshold: float | None = None
    ) -> list[list[SearchHit]]:
        """Exact cosine top-``k`` of ``(Q, D) float32`` queries; ``Q`` lists sorted by descending score.

        ``threshold`` overrides the default match threshold for this call. The index first catches up
        with the store, so every write acknowledged before this call is reflected.
        """
        thr = self._threshold if threshold is None else _check_threshold(threshold)
        validate_gallery_name(gallery)
        self.sync()
        if not self._index.has(gallery):
            self._store.get_gallery(gallery)  # the store's GalleryNotFoundError
        return self._index.search(gallery, queries, k, thr)

    def sizes(self) -> dict[str, int]:
        """``{gallery: number of subjects}`` as the index holds them."""
        return self._index.sizes()

    def close(self) -> None:
        """Stop following and close the store (the index is plain memory)."""
        self._follower.stop()
        self._store.close()
