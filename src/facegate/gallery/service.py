"""The engine's gallery: the store of record and a search index that follows the store's change feed
(:class:`~facegate.gallery.feed.IndexFollower`); the front-end's store calls are
:class:`~facegate.service.gallery.GalleryFront`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from facegate.gallery.base import GalleryStore
from facegate.gallery.feed import IndexFollower, LagHook
from facegate.gallery.index import GalleryIndex

log = logging.getLogger(__name__)

#: Called with ``{gallery: number of subjects}`` after start-up and after every applied change.
StatsHook = Callable[[dict[str, int]], None]


class Gallery:
    """A store and an exact search index, loaded from it here once: the engine's gallery. ``stats_hook`` receives
    ``{gallery: size}`` after start-up and every applied change (serialised; its exceptions are logged);
    ``lag_hook`` per applied batch; ``follow``: also apply changes in a background thread as they commit. Match
    flags are the front-end's (the FPIR policy)."""

    def __init__(
        self,
        store: GalleryStore,
        index: GalleryIndex,
        *,
        stats_hook: StatsHook | None = None,
        lag_hook: LagHook | None = None,
        follow: bool = False,
    ) -> None:
        self.store = store
        self.index = index
        self._stats_hook = stats_hook
        self._stats_lock = threading.Lock()
        self.follower = IndexFollower(store, index, lag_hook=lag_hook, on_applied=self._emit_stats)
        self.follower.load()
        if follow:
            self.follower.start()
        self._emit_stats()

    def sync(self) -> int:
        """Apply every change committed since the index's last one (a cheap ``max(seq)`` read when none), so a
        search after it sees every write acknowledged before by any process sharing the store; returns how many."""
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

    def close(self) -> None:
        self.follower.stop()
        self.store.close()
