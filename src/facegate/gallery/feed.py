"""Keeps a :class:`~facegate.gallery.index.GalleryIndex` current from the store's change feed: a full load once,
then the state-based changes after its last sequence number, in order under one lock (so a write is never
overwritten by a stale snapshot), at each catch-up and from a background thread woken by the store."""

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

#: ``(seconds from commit to index, number of changes applied)`` after each applied batch.
LagHook = Callable[[float, int], None]


class IndexFollower:
    """``index`` following ``store``. ``lag_hook(lag_s, n)`` runs after each applied batch (``lag_s``: seconds
    from the newest change's commit to now); ``on_applied()`` after a catch-up that applied changes."""

    def __init__(
        self,
        store: GalleryStore,
        index: GalleryIndex,
        *,
        lag_hook: LagHook | None = None,
        on_applied: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self._index = index
        self._lag_hook = lag_hook
        self._on_applied = on_applied
        self._seq = 0
        self._loaded = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def seq(self) -> int:  # the last change the index reflects
        return self._seq

    def set_lag_hook(self, hook: LagHook | None) -> None:
        self._lag_hook = hook

    def load(self) -> None:
        """Full load from one store snapshot (start-up only)."""
        t0 = time.perf_counter()
        snap = self._store.load_snapshot()
        with self._lock:
            self._index.load_all(snap.galleries)
            self._seq = snap.seq
            self._loaded = True
        n, secs = sum(len(ids) for _, ids, _ in snap.galleries.values()), time.perf_counter() - t0
        log.info(
            "index: loaded %d galleries, %d subjects at change %d in %.2f s", len(snap.galleries), n, snap.seq, secs
        )

    def catch_up(self, target: int | None = None) -> int:
        """Apply every change after :attr:`seq`; returns how many. A ``target`` already reached (the caller
        read ``store.current_seq()``) returns at once without reading the feed."""
        if not self._loaded:
            raise GalleryError("the gallery index is not loaded yet")
        if target is not None and self._seq >= target:
            return 0
        n = 0
        with self._lock:
            while target is None or self._seq < target:
                batch = self._store.changes_since(self._seq, FEED_BATCH)
                if not batch:
                    break
                for change in batch:
                    self._apply(change)
                    self._seq = change.seq  # a failure part-way resumes here (applying is idempotent)
                n += len(batch)
                if self._lag_hook is not None:
                    self._lag_hook(max(0.0, time.time() - batch[-1].committed_at), len(batch))
                if len(batch) < FEED_BATCH:
                    break
        if n and self._on_applied is not None:
            self._on_applied()
        return n

    def _apply(self, c: Change) -> None:
        """Bring one gallery or subject to the state the change carries (idempotent)."""
        idx = self._index
        if c.op == "delete_gallery":
            idx.drop(c.gallery)
        elif c.op == "create_gallery":
            if c.dim is not None:
                # a gallery deleted and re-created under this name before the feed was read: the later
                # delete_gallery/create_gallery changes bring the index to the final state
                if idx.has(c.gallery) and idx.dim(c.gallery) != c.dim:
                    idx.drop(c.gallery)
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

    def start(self, wait_s: float = 1.0) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(wait_s,), name="gallery-feed", daemon=True)
        self._thread.start()

    def _run(self, wait_s: float) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if self._store.wait_for_change(self._seq, wait_s) and not self._stop.is_set():
                    self.catch_up()
                backoff = 0.1
            except GalleryError as exc:
                # the store is down: searches answer 503 meanwhile; retry with backoff
                log.warning("gallery feed: %s; retrying in %.1f s", exc.message, backoff)
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 5.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        # the thread exits at its next wake-up, within ``wait_s``
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
