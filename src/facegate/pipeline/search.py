"""The engine's gallery search: the request and answer that cross the front-end ↔ engine boundary, the engine's
:class:`Gallery`, and its ``search`` and ``photo_search`` stages (fp16 on CUDA), batched. Torch-free at import.

A request is one ``uint8`` array on the shared-memory transport of photos and crops: a fixed :data:`HEADER` (magic,
``k``, the gallery name), then the ``(D,) float32`` query or the encoded photo's bytes.

The Gallery (the store of record and an index following its change feed) loads the store once, then applies the
state-based changes after its last sequence number, in order under one lock (so a stale snapshot never overwrites
a write), at each :meth:`Gallery.sync` and from a thread woken by the store. Each search batch syncs first, so every
write acknowledged before a query was submitted is in its answer. While the store cannot be opened the stage answers
GalleryUnavailableError (503) and retries at most every :data:`REOPEN_S` seconds.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from facegate.errors import (
    DimensionMismatchError,
    FacegateError,
    GalleryError,
    GalleryUnavailableError,
    InvalidParameterError,
)
from facegate.gallery import open_store
from facegate.gallery.base import Change, GalleryInfo, GalleryStore, validate_gallery_name
from facegate.gallery.index import GalleryIndex

log = logging.getLogger(__name__)

#: ``magic, k, name length, name`` (little-endian, 76 bytes with padding).
HEADER = struct.Struct("<4sIH64sxx")
_MAGIC, _PHOTO_MAGIC = b"FGSQ", b"FGPS"
FEED_BATCH = 10_000  # changes read per round trip
FEED_WAIT_S = 1.0  # the background thread's longest wait for a change (and so for a stop)
REOPEN_S = 2.0  # least seconds between two attempts to open a store that was unreachable


def _encode(magic: bytes, gallery: str, k: int, body: bytes) -> np.ndarray:
    name = validate_gallery_name(gallery).encode("ascii")
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise InvalidParameterError(f"k must be an integer >= 1, got {k!r}", detail={"field": "k"})
    return np.frombuffer(HEADER.pack(magic, int(k), len(name), name) + body, np.uint8)


def _decode(magic: bytes, buf: np.ndarray) -> tuple[str, int, np.ndarray]:
    """``(gallery, k, (n,) uint8 body)`` of a request of ``magic``: a photo search's body is the photo's bytes."""
    arr = np.ascontiguousarray(buf, np.uint8)
    if arr.size < HEADER.size:
        raise InvalidParameterError("malformed search request", detail={"bytes": int(arr.size)})
    got, k, n, name = HEADER.unpack_from(arr[: HEADER.size].tobytes())
    if got != magic or n > len(name):
        raise InvalidParameterError("malformed search request header")
    return name[:n].decode("ascii"), int(k), arr[HEADER.size :]


def encode_search(gallery: str, query: np.ndarray, k: int) -> np.ndarray:
    """One search request: gallery name, ``k >= 1`` and a ``(D,) float32`` query."""
    return _encode(_MAGIC, gallery, k, np.ascontiguousarray(query, dtype="<f4").reshape(-1).tobytes())


def decode_search(buf: np.ndarray) -> tuple[str, int, np.ndarray]:
    """Inverse of :func:`encode_search`: ``(gallery, k, (D,) float32 query)``."""
    gallery, k, body = _decode(_MAGIC, buf)
    if body.size < 4 or body.size % 4:
        raise InvalidParameterError("malformed search request", detail={"bytes": int(body.size) + HEADER.size})
    return gallery, k, body.view("<f4").astype(np.float32)


def encode_photo_search(gallery: str, data: bytes, k: int) -> np.ndarray:
    """A photo search request: gallery name, ``k`` and the encoded photo's bytes."""
    return _encode(_PHOTO_MAGIC, gallery, k, bytes(data))


@dataclass(frozen=True, slots=True)
class SearchOut:
    """The engine's answer to one query: the top ``k`` ``subject_ids`` (fewer when the gallery is smaller),
    their ``(len,) float32`` cosine ``scores`` descending, the gallery's ``size`` N when searched (the FPIR
    of a threshold depends on it) and the change-feed ``seq`` the index was current at."""

    subject_ids: list[str]
    scores: np.ndarray = field(compare=False)
    size: int
    seq: int


class Gallery:
    """A store and an exact search index, loaded from it here once: the engine's gallery. ``stats_hook`` receives
    ``{gallery: size}`` after start-up and every applied change (serialised; its exceptions are logged);
    ``lag_hook(lag_s)`` runs after each applied batch (``lag_s``: seconds from the newest change's commit to
    now); ``follow``: also apply changes in a background thread as they commit."""

    def __init__(
        self,
        store: GalleryStore,
        index: GalleryIndex,
        *,
        stats_hook: Callable[[dict[str, int]], None] = lambda sizes: None,
        lag_hook: Callable[[float], None] = lambda lag_s: None,
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
                self.lag_hook(max(0.0, time.time() - batch[-1].committed_at))
        if n:
            self._emit_stats()
        return n

    def _apply(self, c: Change) -> None:
        """Bring one gallery or subject to the state the change carries (idempotent)."""
        idx = self.index
        if c.op == "delete_gallery":
            idx.drop(c.gallery)
        elif c.op == "create_gallery" and c.dim is not None:
            # a gallery deleted and re-created under this name before the feed was read (ensure_gallery replaces
            # one of another dim): the later delete_gallery/create_gallery changes bring the index to the end state
            idx.ensure_gallery(c.gallery, c.dim)
        elif c.subject_id is not None and idx.entry(c.gallery) is not None:
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


def _try(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except FacegateError as exc:
        return exc


def _decode_alike(payloads: list[np.ndarray]) -> tuple[str, range, list[int], np.ndarray] | None:
    """One decode for requests that differ only in ``k`` and the query (the usual batch): the group ``(gallery,
    rows, ks, (Q, D) float32 queries)``, as :func:`decode_search` would give; else None."""
    head = _try(decode_search, payloads[0]) if payloads else None
    if not isinstance(head, tuple) or len({p.size for p in payloads}) > 1:
        return None
    arr = np.stack(payloads)  # (Q, bytes) uint8; HEADER (<4sIH64sxx) has k in bytes 4:8
    if (arr[:, :4] != arr[0, :4]).any() or (arr[:, 8 : HEADER.size] != arr[0, 8 : HEADER.size]).any():
        return None
    ks = np.ascontiguousarray(arr[:, 4:8]).view("<u4")[:, 0].tolist()
    return head[0], range(len(arr)), ks, np.ascontiguousarray(arr[:, HEADER.size :]).view("<f4")


class SearchStage:
    """Engine stage: ``uint8`` search request → :class:`SearchOut` (or its error). ``open_gallery`` makes the
    engine's Gallery (again after a failure); ``model``: the served ``(name, dim)``, checked by :meth:`check_model`."""

    name = "search"

    def __init__(self, open_gallery: Callable[[], Gallery], model: tuple[str, int]) -> None:
        self._open = open_gallery
        self.model = model
        self._models: dict[str, tuple[Any, GalleryInfo]] = {}  # gallery -> (its index entry, its GalleryInfo)
        self.gallery: Gallery | None = None  # None while its store is unreachable
        self._error: FacegateError | None = None
        self._last_try = -REOPEN_S
        self._lock = threading.Lock()
        with contextlib.suppress(GalleryUnavailableError):  # answered per batch until the store opens
            self._ensure()

    def _ensure(self) -> Gallery:
        with self._lock:
            if self.gallery is None and time.monotonic() - self._last_try >= REOPEN_S:
                self._last_try = time.monotonic()
                try:
                    self.gallery = self._open()
                except GalleryError as exc:
                    log.error("search stage: the gallery store is unavailable: %s", exc.message)
                    self._error = exc
            if self.gallery is not None:
                return self.gallery
            raise GalleryUnavailableError(
                "the gallery store is unavailable: " + (self._error.message if self._error else "not open"),
                detail={"cause": self._error.to_dict() if self._error else None},
            )

    def prepare(self, payloads: list[np.ndarray]) -> tuple[Gallery, list[Any], list[Any]]:
        group = _decode_alike(payloads)
        return self.plan([None] * len(payloads) if group else [_try(decode_search, p) for p in payloads], group)

    def plan(self, items: list[Any], group: Any = None) -> tuple[Gallery, list[Any], list[Any]]:
        """Items ``(gallery, k, (D,) float32 query)`` (or errors) grouped per gallery (or the one ``group``) for
        :meth:`execute`, after a catch-up: the batch has formed, so it sees every write acknowledged before."""
        gallery = self._ensure()
        gallery.sync()
        rows: dict[str, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            if isinstance(item, tuple):
                rows[item[0]].append(i)
        groups = [(g, r, [items[i][1] for i in r], np.stack([items[i][2] for i in r])) for g, r in rows.items()]
        return gallery, list(items), [group] if group else groups

    def check_model(self, gallery: Gallery, name: str) -> None:
        """GalleryNotFoundError for a missing gallery, DimensionMismatchError (409) for another model's; the store
        is read once per index entry of the gallery."""
        entry = gallery.index.entry(name)
        got = self._models.get(name)
        if got is None or entry is None or got[0] is not entry:
            got = (entry, gallery.store.get_gallery(name))
            if entry is not None:
                self._models[name] = got
        got[1].check_model(*self.model)

    def execute(self, plan: tuple[Gallery, list[Any], list[Any]]) -> list[Any]:
        """Per item its :class:`SearchOut`, or its error: one matrix product and one top-k per gallery."""
        gallery, results, groups = plan
        seq, index = gallery.seq, gallery.index
        for name, rows, ks, queries in groups:
            try:
                if index.entry(name) is None:
                    gallery.store.get_gallery(name)  # the store's GalleryNotFoundError
                hits, n = index.search_raw(name, queries, max(ks))
            except FacegateError as exc:
                for i in rows:
                    results[i] = exc
                continue
            for (ids, scores), i, k in zip(hits, rows, ks, strict=True):
                results[i] = SearchOut(ids if k >= len(ids) else ids[:k], scores[:k], n, seq)
        return results

    @classmethod
    def from_settings(cls, settings: Any, device: str, model: tuple[str, int], **hooks: Any) -> SearchStage:
        """The stage over the gallery store ``settings`` name, with its index on ``device`` (fp16 on CUDA), for
        the served ``model`` (name, dim); ``hooks``: the Gallery's ``stats_hook`` and ``lag_hook``."""

        def open_gallery() -> Gallery:
            # short: a batch waits on this while the store is down (other stages keep running)
            retry_s = min(settings.gallery_open_retry_s, REOPEN_S)
            store = open_store(settings.gallery_url, data_dir=settings.data_dir, open_retry_s=retry_s)
            try:
                index = GalleryIndex(device, "float16" if str(device).startswith("cuda") else "float32")
                # match flags are the front-end's (the FPIR policy); the stage returns raw scores
                return Gallery(store, index, follow=True, **hooks)
            except BaseException:
                store.close()
                raise

        return cls(open_gallery, model)

    def close(self) -> None:
        with self._lock:
            if self.gallery is not None:
                self.gallery.close()
                self.gallery = None


class PhotoSearchStage:
    """Engine stage ``photo_search``: an encoded photo (:func:`~facegate.pipeline.search.encode_photo_search`) →
    ``(PhotoFaces, SearchOut)`` or its error, over the engine's ``photo`` and ``search`` stages. On a torch index
    the search is queued behind the embeddings, so faces and hits share the photo stage's one device→host copy."""

    name = "photo_search"

    def __init__(self, photo: Any, search: SearchStage) -> None:
        self._photo = photo
        self._search = search

    def prepare(self, payloads: list[np.ndarray]) -> tuple[list[Any], Any, Any]:
        heads = [_try(_decode, _PHOTO_MAGIC, p) for p in payloads]
        gallery = self._search._ensure()
        gallery.sync()
        checked: dict[str, FacegateError | None] = {}
        for i, h in enumerate(heads):
            if not isinstance(h, FacegateError):
                if h[0] not in checked:
                    checked[h[0]] = _try(self._search.check_model, gallery, h[0])
                heads[i] = checked[h[0]] or h  # a gallery that is missing or of another model: its error
        photos = [h[2] for h in heads if not isinstance(h, FacegateError)]
        return heads, (self._photo.prepare(photos) if photos else None), gallery

    def execute(self, prepared: tuple[list[Any], Any, Any]) -> list[Any]:
        heads, photo_prepared, gallery = prepared
        live = [i for i, h in enumerate(heads) if not isinstance(h, FacegateError)]  # photo j is item live[j]
        got, found = list(heads), {}
        if photo_prepared is not None:
            with contextlib.ExitStack() as hold:  # the galleries' locks, from the search's launch to its answer
                launched: list[tuple[list[int], int, Any]] = []
                launch = functools.partial(self._launch, gallery, heads, live, hold, launched)
                faces, host, void = self._photo.execute_with(photo_prepared, launch if gallery.index.on_torch else None)
                for j, f in enumerate(faces):
                    got[live[j]] = f
                at = 0
                for rows, width, finish in launched:
                    hits, n = finish(host[at : at + len(rows) * width].reshape(len(rows), width))
                    at += len(rows) * width
                    for (ids, scores), j in zip(hits, rows, strict=True):
                        if j not in void:
                            k = heads[live[j]][1]
                            found[live[j]] = SearchOut(ids[:k], scores[:k], n, gallery.seq)
        rest = [i for i in live if i not in found and not isinstance(got[i], BaseException)]
        if rest:  # a NumPy index, an empty gallery, the host rule's photos: the search on its own
            items = [(heads[i][0], heads[i][1], np.asarray(got[i].embedding[0], np.float32)) for i in rest]
            found.update(zip(rest, self._search.execute(self._search.plan(items)), strict=True))
        return [g if isinstance(g, BaseException) else found[i] if isinstance(found[i], BaseException)
                else (g, found[i]) for i, g in enumerate(got)]  # fmt: skip

    @staticmethod
    def _launch(
        gallery: Any, heads: list[Any], live: list[int], hold: Any, launched: list[Any], emb: Any, owners: list[int]
    ) -> Any:
        """Queue each gallery's search of its photos' rows of ``emb (K, D)``; the flat float32 device tensor."""
        import torch

        by_name: dict[str, list[int]] = defaultdict(list)  # gallery -> rows of emb
        for r, j in enumerate(owners):
            by_name[heads[live[j]][0]].append(r)
        parts = []
        for name, rows in by_name.items():
            if len(rows) == len(owners):
                q = emb
            else:  # pinned and non-blocking: a blocking copy up would wait for the device's queued work
                q = emb[torch.tensor(rows, pin_memory=emb.is_cuda).to(emb.device, non_blocking=True)]
            try:
                packed, finish = gallery.index.launch(name, q, max(heads[live[owners[r]]][1] for r in rows), hold)
            except FacegateError:
                continue  # answered by the search on its own
            if packed is not None:
                parts.append(packed.flatten())
                launched.append(([owners[r] for r in rows], packed.shape[1], finish))
        return torch.cat(parts) if parts else None
