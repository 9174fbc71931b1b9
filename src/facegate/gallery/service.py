"""Galleries on the store of record: :class:`StoreFront` (writes and reads) and :class:`Gallery` (with a search
index that follows the store's change feed, :class:`~facegate.gallery.feed.IndexFollower`).

A search first catches up to the store's current sequence number (a cheap ``max(seq)``), so a write
acknowledged by any process sharing the store is visible to every later search. Callers must check that
:attr:`GalleryInfo.model` produced the embeddings they pass (the store only checks ``dim``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from facegate.errors import InvalidParameterError
from facegate.gallery.base import EnrolItem, GalleryInfo, GalleryStore, SearchHit, SubjectInfo, validate_gallery_name
from facegate.gallery.feed import IndexFollower, LagHook
from facegate.gallery.index import GalleryIndex

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Called with ``{gallery: number of subjects}`` after start-up and after every applied write.
StatsHook = Callable[[dict[str, int]], None]


class StoreFront:
    """The gallery calls on the store of record ``store``; :meth:`_written` runs after each committed write."""

    def __init__(self, store: GalleryStore) -> None:
        self.store = store

    def _written(self) -> None:
        """After a committed write (nothing here: a front-end holds no index)."""

    def _wrote(self, result: _T) -> _T:
        self._written()
        return result

    def create_gallery(self, name: str, model: str, dim: int) -> GalleryInfo:
        return self._wrote(self.store.create_gallery(name, model, dim))

    def list_galleries(self) -> list[GalleryInfo]:
        return self.store.list_galleries()

    def get_gallery(self, name: str) -> GalleryInfo:
        return self.store.get_gallery(name)

    def delete_gallery(self, name: str) -> None:
        self._wrote(self.store.delete_gallery(name))

    def enrol(
        self, gallery: str, subject_id: str, emb: np.ndarray, qual: np.ndarray, meta: dict[str, Any] | None = None
    ) -> SubjectInfo:
        """Add ``(k, D) float32`` unit-norm embeddings with ``(k,)`` qualities to a subject (created if new)."""
        return self._wrote(self.store.add_embeddings(gallery, subject_id, emb, qual, meta))

    def enrol_many(self, gallery: str, items: list[EnrolItem]) -> list[SubjectInfo]:
        """:meth:`enrol` of many ``(subject_id, emb, qual, meta)`` in one transaction."""
        return self._wrote(self.store.enrol_many(gallery, items))

    def import_templates(
        self, gallery: str, subject_ids: list[str], templates: np.ndarray, qualities: np.ndarray | None = None
    ) -> int:
        """Bulk-enrol ``(S, D) float32`` unit-norm templates (qualities default to 1). Returns S."""
        q = np.ones(len(subject_ids), np.float32) if qualities is None else qualities
        return self._wrote(self.store.import_templates(gallery, list(subject_ids), templates, q))

    def get_subject(self, gallery: str, subject_id: str) -> SubjectInfo:
        return self.store.get_subject(gallery, subject_id)

    def list_subjects(self, gallery: str, offset: int = 0, limit: int = 100) -> list[SubjectInfo]:
        return self.store.list_subjects(gallery, offset, limit)

    def delete_subject(self, gallery: str, subject_id: str) -> None:
        """Erase a subject (every index drops it before its next search)."""
        self._wrote(self.store.delete_subject(gallery, subject_id))

    def close(self) -> None:
        self.store.close()


def _check_threshold(value: object) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(float(value))
    if not ok or not -1.0 <= float(value) <= 1.0:  # type: ignore[arg-type]
        raise InvalidParameterError(
            f"match threshold must be a cosine similarity in [-1, 1], got {value!r}", detail={"field": "threshold"}
        )
    return float(value)  # type: ignore[arg-type]


class Gallery(StoreFront):
    """A store and an exact search index (loaded from it here, once) current with it at every search: the
    engine's gallery. ``match_threshold``: the default of :attr:`SearchHit.match`; ``stats_hook`` receives
    ``{gallery: size}`` after start-up and every applied write (serialised; its exceptions are logged);
    ``lag_hook`` per applied batch; ``follow``: also apply foreign changes in a background thread."""

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
        super().__init__(store)
        self.index = index
        self.match_threshold = _check_threshold(match_threshold)
        self._stats_hook = stats_hook
        self._stats_lock = threading.Lock()
        self.follower = IndexFollower(store, index, lag_hook=lag_hook, on_applied=self._emit_stats)
        self.follower.load()
        if follow:
            self.follower.start()
        self._emit_stats()

    def sync(self) -> int:
        """Apply every change committed since the index's last one; returns how many."""
        return self.follower.catch_up(self.store.current_seq())

    def set_stats_hook(self, hook: StatsHook | None) -> None:
        """Install (or remove) the stats hook and call it once with the current sizes."""
        self._stats_hook = hook
        self._emit_stats()

    def _emit_stats(self) -> None:
        # sizes are read under the lock, so the last call carries the newest
        with self._stats_lock:
            if self._stats_hook is None:
                return
            try:
                self._stats_hook(self.index.sizes())
            except Exception:
                log.exception("gallery stats hook failed")

    def _written(self) -> None:
        """Bring the index up to the committed write. The write is acknowledged even when that fails: the
        change stays in the feed and the next search applies it first (or fails rather than miss it)."""
        try:
            if self.follower.catch_up():
                return  # the follower reported the new sizes
        except Exception as exc:
            log.warning("gallery index: a committed change is not applied yet (%s); the next search applies it", exc)
        self._emit_stats()

    def search(
        self, gallery: str, queries: np.ndarray, k: int = 1, threshold: float | None = None
    ) -> list[list[SearchHit]]:
        """Exact cosine top-``k`` of ``(Q, D) float32`` queries, each list by descending score, after
        catching up with the store; ``threshold`` overrides the default match threshold."""
        thr = self.match_threshold if threshold is None else _check_threshold(threshold)
        validate_gallery_name(gallery)
        self.sync()
        if not self.index.has(gallery):
            self.store.get_gallery(gallery)  # the store's GalleryNotFoundError
        return self.index.search(gallery, queries, k, thr)

    def sizes(self) -> dict[str, int]:
        """``{gallery: number of subjects}`` as the index holds them."""
        return self.index.sizes()

    def close(self) -> None:
        self.follower.stop()
        self.store.close()
