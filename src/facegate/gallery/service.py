"""The engine's gallery: the store of record and a search index that follows the store's change feed
(:class:`~facegate.gallery.feed.IndexFollower`); the front-end's store calls are
:class:`~facegate.service.gallery.GalleryFront`'s.

A search first catches up to the store's current sequence number (a cheap ``max(seq)``), so a write
acknowledged by any process sharing the store is visible to every later search.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import numpy as np

from facegate.errors import InvalidParameterError
from facegate.gallery.base import GalleryStore, SearchHit, validate_gallery_name
from facegate.gallery.feed import IndexFollower, LagHook
from facegate.gallery.index import GalleryIndex

log = logging.getLogger(__name__)

#: Called with ``{gallery: number of subjects}`` after start-up and after every applied change.
StatsHook = Callable[[dict[str, int]], None]


def _check_threshold(value: object) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(float(value))
    if not ok or not -1.0 <= float(value) <= 1.0:  # type: ignore[arg-type]
        raise InvalidParameterError(
            f"match threshold must be a cosine similarity in [-1, 1], got {value!r}", detail={"field": "threshold"}
        )
    return float(value)  # type: ignore[arg-type]


class Gallery:
    """A store and an exact search index (loaded from it here, once) current with it at every search: the
    engine's gallery. ``match_threshold``: the default of :attr:`SearchHit.match`; ``stats_hook`` receives
    ``{gallery: size}`` after start-up and every applied change (serialised; its exceptions are logged);
    ``lag_hook`` per applied batch; ``follow``: also apply changes in a background thread as they commit."""

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
        self.store = store
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
