"""The engine's ``search`` stages: 1:N search over the engine's one gallery index (fp16 on CUDA), batched.

Each batch first catches the index up to the store's sequence number, so every write acknowledged before a query
was submitted is in its answer. While the store cannot be opened the stage answers GalleryUnavailableError (503)
and retries at most every :data:`REOPEN_S` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from facegate.errors import FacegateError, GalleryError, GalleryUnavailableError
from facegate.gallery.query import HEADER, SearchOut, decode_photo_search, decode_search

log = logging.getLogger(__name__)

#: Least seconds between two attempts to open a store that was unreachable.
REOPEN_S = 2.0


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

    def __init__(self, open_gallery: Callable[[], Any], model: tuple[str, int] | None = None) -> None:
        self._open = open_gallery
        self.model = model
        self._models: dict[str, tuple[Any, Any]] = {}  # gallery -> (its index entry, its GalleryInfo)
        self.gallery: Any = None  # the engine's Gallery, None while its store is unreachable
        self._error: FacegateError | None = None
        self._last_try = -REOPEN_S
        self._lock = threading.Lock()
        with contextlib.suppress(GalleryUnavailableError):  # answered per batch until the store opens
            self._ensure()

    def _ensure(self) -> Any:
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

    def prepare(self, payloads: list[np.ndarray]) -> tuple[Any, list[Any], list[Any]]:
        group = _decode_alike(payloads)
        return self.plan([None] * len(payloads) if group else [_try(decode_search, p) for p in payloads], group)

    def plan(self, items: list[Any], group: Any = None) -> tuple[Any, list[Any], list[Any]]:
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

    def check_model(self, gallery: Any, name: str) -> None:
        """GalleryNotFoundError for a missing gallery, DimensionMismatchError (409) for another model's; the store
        is read once per index entry of the gallery."""
        if self.model is None:
            return
        entry = gallery.index.entry(name)
        got = self._models.get(name)
        if got is None or entry is None or got[0] is not entry:
            got = (entry, gallery.store.get_gallery(name))
            if entry is not None:
                self._models[name] = got
        got[1].check_model(*self.model)

    def execute(self, plan: tuple[Any, list[Any], list[Any]]) -> list[Any]:
        """Per item its :class:`SearchOut`, or its error: one matrix product and one top-k per gallery."""
        gallery, results, groups = plan
        seq, index = gallery.seq, gallery.index
        for name, rows, ks, queries in groups:
            try:
                if not index.has(name):
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
    def from_settings(
        cls, settings: Any, device: str, model: tuple[str, int] | None = None, **hooks: Any
    ) -> SearchStage:
        """The stage over the gallery store ``settings`` name, with its index on ``device`` (fp16 on CUDA), for
        the served ``model`` (name, dim); ``hooks``: the Gallery's ``stats_hook`` and ``lag_hook``."""

        def open_gallery() -> Any:
            from facegate.gallery import open_store
            from facegate.gallery.index import GalleryIndex
            from facegate.gallery.service import Gallery

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
    """Engine stage ``photo_search``: an encoded photo (:func:`~facegate.gallery.query.encode_photo_search`) →
    ``(PhotoFaces, SearchOut)`` or its error, over the engine's ``photo`` and ``search`` stages. On a torch index
    the search is queued behind the embeddings, so faces and hits share the photo stage's one device→host copy."""

    name = "photo_search"

    def __init__(self, photo: Any, search: SearchStage) -> None:
        self._photo = photo
        self._search = search

    def prepare(self, payloads: list[np.ndarray]) -> tuple[list[Any], Any, Any]:
        heads = [_try(decode_photo_search, p) for p in payloads]
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
        if photo_prepared is not None and not gallery.index.on_torch:  # a NumPy index: the search on its own
            for j, f in enumerate(self._photo.execute(photo_prepared)):
                got[live[j]] = f
        elif photo_prepared is not None:
            with contextlib.ExitStack() as hold:  # the galleries' locks, from the search's launch to its answer
                launched: list[tuple[list[int], int, Any]] = []
                faces, host, void = self._photo.execute_with(
                    photo_prepared, lambda emb, owners: self._launch(gallery, heads, live, emb, owners, hold, launched)
                )
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
        gallery: Any, heads: list[Any], live: list[int], emb: Any, owners: list[int], hold: Any, launched: list[Any]
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
                at = torch.tensor(rows)
                q = emb[(at.pin_memory() if emb.is_cuda else at).to(emb.device, non_blocking=True)]
            try:
                packed, finish = gallery.index.launch(name, q, max(heads[live[owners[r]]][1] for r in rows), hold)
            except FacegateError:
                continue  # answered by the search on its own
            if packed is not None:
                parts.append(packed.flatten())
                launched.append(([owners[r] for r in rows], packed.shape[1], finish))
        return torch.cat(parts) if parts else None
