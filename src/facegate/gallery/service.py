"""The engine's gallery: the store of record and a search index that follows the store's change feed. A full load
once, then the state-based changes after its last sequence number, in order under one lock (so a write is never
overwritten by a stale snapshot), at each :meth:`Gallery.sync` and from a background thread woken by the store.
The front-end's store calls are :class:`~facegate.service.gallery.GalleryFront`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from facegate.errors import DimensionMismatchError, GalleryError
from facegate.gallery.base import Change, GalleryStore
from facegate.gallery.index import GalleryIndex

log = logging.getLogger(__name__)

FEED_BATCH = 10_000  # changes read per round trip
FEED_WAIT_S = 1.0  # the background thread's longest wait for a change (and so for a stop)


class Gallery:
    """A store and an exact search index, loaded from it here once: the engine's gallery. ``stats_hook`` receives
    ``{gallery: size}`` after start-up and every applied change (serialised; its exceptions are logged);
    ``lag_hook(lag_s, n)`` runs after each applied batch (``lag_s``: seconds from the newest change's commit to
    now); ``follow``: also apply changes in a background thread as they commit. Match flags are the front-end's
    (the FPIR policy)."""

    def __init__(
        self,
        store: GalleryStore,
        index: GalleryIndex,
        *,
        stats_hook: Callable[[dict[str, int]], None] | None = None,
        lag_hook: Callable[[float, int], None] | None = None,
        follow: bool = False,
    ) -> None:
        self.store = store
        self.index = index
        self.lag_hook = lag_hook
        self._stats_hook = stats_hook
        self._stats_lock = threading.Lock()
        self._lock = threading.Lock()  # applies changes in order
        self._stop = threading.Event()
        t0 = time.perf_counter()
        self.seq, galleries = store.load_snapshot()  # seq: the last change the index reflects
        index.load_all(galleries)
        n, secs = sum(len(ids) for _, ids, _ in galleries.values()), time.perf_counter() - t0
        log.info("index: loaded %d galleries, %d subjects at change %d in %.2f s", len(galleries), n, self.seq, secs)
        self._thread: threading.Thread | None = None
        if follow:
            self._thread = threading.Thread(target=self._run, name="gallery-feed", daemon=True)
            self._thread.start()
        self._emit_stats()

    def sync(self) -> int:
        """Apply every change committed since the index's last one (a cheap ``max(seq)`` read when none), so a
        search after it sees every write acknowledged before by any process sharing the store; returns how many."""
        target = self.store.current_seq()
        if self.seq >= target:
            return 0
        n = 0
        with self._lock:
            while self.seq < target and (batch := self.store.changes_since(self.seq, FEED_BATCH)):
                for change in batch:
                    self._apply(change)
                    self.seq = change.seq  # a failure part-way resumes here (applying is idempotent)
                n += len(batch)
                if self.lag_hook is not None:
                    self.lag_hook(max(0.0, time.time() - batch[-1].committed_at), len(batch))
        if n:
            self._emit_stats()
        return n

    def _apply(self, c: Change) -> None:
        """Bring one gallery or subject to the state the change carries (idempotent)."""
        idx = self.index
        if c.op == "delete_gallery":
            idx.drop(c.gallery)
        elif c.op == "create_gallery":
            if c.dim is not None:
                # a gallery deleted and re-created under this name before the feed was read (ensure_gallery replaces
                # one of another dim): the later delete_gallery/create_gallery changes bring the index to the end state
                idx.ensure_gallery(c.gallery, c.dim)
        elif c.subject_id is not None and idx.has(c.gallery):
            if c.template is None:
                idx.remove(c.gallery, c.subject_id)
            else:
                try:
                    idx.upsert(c.gallery, c.subject_id, c.template)
                except DimensionMismatchError:
                    # the gallery was re-created with another dim; a later change drops and re-adds it
                    log.debug("index: skipped %s of %r in re-created gallery %r", c.op, c.subject_id, c.gallery)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if self.store.wait_for_change(self.seq, FEED_WAIT_S) and not self._stop.is_set():
                    self.sync()
                backoff = 0.1
            except GalleryError as exc:
                # the store is down: searches answer 503 meanwhile; retry with backoff
                log.warning("gallery feed: %s; retrying in %.1f s", exc.message, backoff)
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 5.0)

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
        self._stop.set()  # the feed thread exits at its next wake-up, within FEED_WAIT_S
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        self.store.close()
