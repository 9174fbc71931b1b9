"""Exact 1:N search index, in NumPy on the CPU or in torch on an accelerator.

Per gallery the index keeps a ``(capacity, D)`` matrix of unit-norm templates (rows ``[0, n)`` are live)
plus the list of subject ids in row order and an ``id -> row`` dict. A search is one matmul
``(Q, D) @ (D, n)`` and one top-k. It is exact (no approximation): with unit-norm rows the dot product
is the cosine similarity.

On the CPU in float32/float64 the matrices are NumPy arrays (a BLAS matmul, ``argpartition``), so the
HTTP front-ends, which search on the CPU, never import torch (they held 549 MiB each with the CUDA build in
the GPU soak, 266 MiB against 86 MiB on the CPU build: ``benchmarks/results/frontend_footprint_cpu.json``).
A one-query search (what the HTTP route sends) was as fast as torch's at 10k templates, 2.1× faster at 200k;
16 queries at once were 2.1–2.3× slower (``argpartition`` against ``torch.topk``;
``benchmarks/results/gallery_search_cpu.json``). Otherwise (a CUDA device, or half precision) they are torch
tensors, imported on first use, and a search ends with one device→host copy of the packed
``(scores, indices)``.

Updates are in place:

* upsert of an existing subject overwrites its row: O(D);
* upsert of a new subject appends a row; when the buffer is full it is reallocated at twice the size
  (O(S·D), amortised O(D));
* remove moves the last row into the hole ("swap-remove"): O(D) plus the id bookkeeping; the buffer
  shrinks to half when it is less than a quarter full.

Row order is therefore not subject-id order; results are ranked by score only.

Thread safety: each gallery has its own lock, held by writes and by searches (matmul, topk, the host
copy and the index→id lookup), so a search never sees a half-applied update. Searches of one gallery
are therefore serialised; batch queries (Q > 1) instead of issuing parallel searches.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from facegate.errors import DimensionMismatchError, GalleryError, GalleryNotFoundError, InvalidParameterError
from facegate.gallery.base import GalleryInfo, SearchHit

log = logging.getLogger(__name__)

#: Smallest buffer, in rows, allocated for a gallery.
_MIN_CAPACITY = 64
_DTYPES = ("float32", "float64", "float16", "bfloat16")


class _NumpyOps:
    """Template matrices as NumPy arrays (CPU, float32/float64)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = np.dtype(dtype)

    def zeros(self, rows: int, dim: int) -> np.ndarray:
        return np.zeros((rows, dim), self.dtype)

    def from_numpy(self, arr: np.ndarray) -> np.ndarray:
        return np.asarray(arr, self.dtype)

    @staticmethod
    def copy(x: np.ndarray) -> np.ndarray:
        return x.copy()

    @staticmethod
    def to_host(x: np.ndarray) -> np.ndarray:
        return np.array(x, np.float32)

    def topk(self, q: np.ndarray, mat: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(Q, k) float64`` scores, descending, and ``(Q, k) int64`` rows of ``mat``."""
        scores = self.from_numpy(q) @ mat.T
        n = scores.shape[1]
        idx = np.argpartition(scores, n - k, axis=1)[:, n - k :] if k < n else np.argsort(-scores, axis=1)
        vals = np.take_along_axis(scores, idx, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        return np.take_along_axis(vals, order, axis=1).astype(np.float64), np.take_along_axis(idx, order, axis=1)


class _TorchOps:
    """Template matrices as torch tensors on ``device`` (torch imported here, on first use)."""

    def __init__(self, device: Any, dtype: str) -> None:
        import torch

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)

    def zeros(self, rows: int, dim: int) -> Any:
        # never an inference tensor, even when a search thread grows the matrix: the feed thread writes
        # into it later, outside inference mode
        with self.torch.inference_mode(False):
            return self.torch.zeros((rows, dim), dtype=self.dtype, device=self.device)

    def from_numpy(self, arr: np.ndarray) -> Any:
        with self.torch.inference_mode(False):
            return self.torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(self.device, self.dtype)

    def copy(self, x: Any) -> Any:
        with self.torch.inference_mode(False):
            return x.clone()

    def to_host(self, x: Any) -> np.ndarray:
        return x.to("cpu", self.torch.float32).numpy().copy()

    def topk(self, q: np.ndarray, mat: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        torch = self.torch
        with torch.inference_mode():
            top_v, top_i = torch.topk(self.from_numpy(q) @ mat.T, k, dim=1, largest=True, sorted=True)
            # one device->host copy: float64 holds indices < 2**53 exactly
            packed = torch.cat((top_v.to(torch.float64), top_i.to(torch.float64)), dim=1).cpu().numpy()
        return packed[:, :k], packed[:, k:].astype(np.int64)


class TemplateSource(Protocol):
    """The part of :class:`~facegate.gallery.base.GalleryStore` the index reads at (re)build time."""

    def list_galleries(self) -> list[GalleryInfo]: ...

    def get_gallery(self, name: str) -> GalleryInfo: ...

    def load_templates(self, gallery: str) -> tuple[list[str], np.ndarray]: ...


@dataclass(eq=False)
class _Entry:
    """One gallery's slice of the index. ``mat[:n]`` are the live rows; ``ids[i]`` owns row ``i``."""

    dim: int
    mat: Any  # (capacity, dim) np.ndarray or torch.Tensor
    ids: list[str] = field(default_factory=list)
    pos: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def n(self) -> int:
        return len(self.ids)


class GalleryIndex:
    """Exact cosine top-k over every gallery's templates, on ``device``.

    Args:
        device: where the template matrices live and the search runs (``"cpu"``, ``"cuda"``, a
            ``torch.device``).
        dtype: storage/compute dtype of the templates, a name or a torch dtype: ``float32`` (default),
            ``float64``, or ``float16``/``bfloat16`` (half the memory on CUDA at ~1e-3 score error).
            Queries are cast to it. CPU with float32/float64 uses NumPy; anything else torch.
    """

    def __init__(self, device: Any = "cpu", dtype: Any = "float32") -> None:
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise InvalidParameterError(f"unsupported index dtype {dtype}", detail={"field": "dtype"})
        self.dtype = name
        self._ops: _NumpyOps | _TorchOps
        if str(device) == "cpu" and name in ("float32", "float64"):
            self.device = "cpu"
            self._ops = _NumpyOps(name)
        else:
            try:
                self._ops = _TorchOps(device, name)
            except (RuntimeError, TypeError) as exc:
                raise InvalidParameterError(f"invalid index device {device!r}: {exc}") from exc
            self.device = str(self._ops.device)
        self._entries: dict[str, _Entry] = {}
        self._guard = threading.Lock()  # protects the dict itself, not the entries' contents

    # ------------------------------------------------------------------ helpers
    def _entry(self, gallery: str) -> _Entry:
        with self._guard:
            entry = self._entries.get(gallery)
        if entry is None:
            raise GalleryNotFoundError(f"gallery {gallery!r} is not in the search index", detail={"gallery": gallery})
        return entry

    def _alloc(self, rows: int, dim: int) -> Any:
        try:
            return self._ops.zeros(max(rows, _MIN_CAPACITY), dim)
        except (RuntimeError, MemoryError) as exc:  # e.g. CUDA OOM
            raise GalleryError(f"cannot allocate a {rows}x{dim} gallery index on {self.device}: {exc}") from exc

    def _to_device(self, arr: np.ndarray) -> Any:
        return self._ops.from_numpy(arr)

    def _make_entry(self, dim: int, ids: list[str], templates: np.ndarray) -> _Entry:
        if templates.shape != (len(ids), dim):
            raise DimensionMismatchError(
                f"templates of shape {templates.shape} do not fit {len(ids)} ids x dim {dim}",
                detail={"expected": [len(ids), dim], "got": list(templates.shape)},
            )
        if len(set(ids)) != len(ids):
            raise GalleryError("duplicate subject ids in the templates loaded for the index")
        mat = self._alloc(len(ids), dim)
        if ids:
            mat[: len(ids)] = self._to_device(templates)
        return _Entry(dim=dim, mat=mat, ids=list(ids), pos={s: i for i, s in enumerate(ids)})

    # ------------------------------------------------------------------ galleries
    def has(self, gallery: str) -> bool:
        """Whether ``gallery`` is loaded."""
        with self._guard:
            return gallery in self._entries

    def ensure_gallery(self, gallery: str, dim: int) -> None:
        """Add an empty gallery of dimension ``dim`` (no-op when present with the same dim)."""
        with self._guard:
            entry = self._entries.get(gallery)
            if entry is not None:
                if entry.dim != dim:
                    raise DimensionMismatchError(
                        f"index gallery {gallery!r} has dim {entry.dim}, not {dim}",
                        detail={"expected": entry.dim, "got": dim},
                    )
                return
            self._entries[gallery] = self._make_entry(dim, [], np.zeros((0, dim), np.float32))

    def load_gallery(self, gallery: str, dim: int, subject_ids: list[str], templates: np.ndarray) -> None:
        """Replace a gallery's contents wholesale with ``templates`` ``(S, D) float32`` (row i = ids[i])."""
        entry = self._make_entry(dim, subject_ids, np.asarray(templates, dtype=np.float32))
        with self._guard:
            self._entries[gallery] = entry

    def dim(self, gallery: str) -> int:
        """A loaded gallery's embedding size D."""
        return self._entry(gallery).dim

    def load_all(self, galleries: dict[str, tuple[int, list[str], np.ndarray]]) -> None:
        """Replace every gallery at once: ``{name: (dim, subject_ids, (S, D) float32 templates)}``."""
        fresh = {
            name: self._make_entry(int(dim), ids, np.asarray(t, dtype=np.float32))
            for name, (dim, ids, t) in galleries.items()
        }
        with self._guard:
            self._entries = fresh

    def drop(self, gallery: str) -> None:
        """Forget a gallery (no-op when absent)."""
        with self._guard:
            self._entries.pop(gallery, None)

    def rebuild_gallery(self, store: TemplateSource, gallery: str) -> None:
        """Reload one gallery from ``store`` (raises GalleryNotFoundError if the store lacks it)."""
        info = store.get_gallery(gallery)
        ids, templates = store.load_templates(gallery)
        self.load_gallery(gallery, int(info.dim), ids, templates)
        log.info("index: rebuilt gallery %r (%d subjects) on %s", gallery, len(ids), self.device)

    def rebuild(self, store: TemplateSource) -> None:
        """Load every gallery from ``store``, replacing whatever the index held."""
        fresh: dict[str, _Entry] = {}
        for info in store.list_galleries():
            ids, templates = store.load_templates(info.name)
            fresh[info.name] = self._make_entry(int(info.dim), ids, np.asarray(templates, dtype=np.float32))
        with self._guard:
            self._entries = fresh
        log.info(
            "index: loaded %d galleries, %d subjects on %s (%s)",
            len(fresh),
            sum(e.n for e in fresh.values()),
            self.device,
            self.dtype,
        )

    # ------------------------------------------------------------------ subjects
    def upsert(self, gallery: str, subject_id: str, template: np.ndarray) -> None:
        """Insert or overwrite one subject's template ``(D,) float32`` (unit norm)."""
        entry = self._entry(gallery)
        vec = np.asarray(template, dtype=np.float32)
        if vec.shape != (entry.dim,):
            raise DimensionMismatchError(
                f"template of shape {vec.shape} does not fit gallery {gallery!r} of dim {entry.dim}",
                detail={"expected": entry.dim, "got": list(vec.shape)},
            )
        row = self._to_device(vec)
        with entry.lock:
            i = entry.pos.get(subject_id)
            if i is None:
                i = entry.n
                if i == entry.mat.shape[0]:
                    grown = self._alloc(2 * i, entry.dim)
                    grown[:i] = entry.mat[:i]
                    entry.mat = grown
                entry.mat[i] = row
                entry.ids.append(subject_id)
                entry.pos[subject_id] = i
            else:
                entry.mat[i] = row

    def remove(self, gallery: str, subject_id: str) -> bool:
        """Remove one subject (swap-remove); returns whether it was present."""
        entry = self._entry(gallery)
        with entry.lock:
            i = entry.pos.pop(subject_id, None)
            if i is None:
                return False
            last = entry.n - 1
            if i != last:
                moved = entry.ids[last]
                entry.mat[i] = entry.mat[last]
                entry.ids[i] = moved
                entry.pos[moved] = i
            entry.ids.pop()
            entry.mat[last] = 0
            cap = entry.mat.shape[0]
            if cap > _MIN_CAPACITY and entry.n < cap // 4:
                entry.mat = self._ops.copy(entry.mat[: max(2 * entry.n, _MIN_CAPACITY)])
            return True

    # ------------------------------------------------------------------ queries
    def size(self, gallery: str) -> int:
        """Number of subjects in a gallery."""
        return self._entry(gallery).n

    def sizes(self) -> dict[str, int]:
        """``{gallery: number of subjects}`` of every loaded gallery."""
        with self._guard:
            entries = dict(self._entries)
        return {name: e.n for name, e in sorted(entries.items())}

    def snapshot(self, gallery: str) -> tuple[list[str], np.ndarray]:
        """``(subject_ids, (S, D) float32 templates)`` as held now, sorted by subject id (for checks)."""
        entry = self._entry(gallery)
        with entry.lock:
            ids = list(entry.ids)
            mat = self._ops.to_host(entry.mat[: entry.n])
        order = sorted(range(len(ids)), key=ids.__getitem__)
        return [ids[i] for i in order], mat[order] if ids else mat

    def search_raw(self, gallery: str, queries: np.ndarray, k: int) -> tuple[list[tuple[list[str], np.ndarray]], int]:
        """Exact cosine top-k of a batch: one matrix product and one top-k.

        Args:
            queries: ``(Q, D) float32`` embeddings (normalised here, so any non-zero scale works).
            k: hits per query, ``>= 1``; fewer when the gallery has fewer subjects.

        Returns:
            per query ``(subject_ids, (k,) float32 scores)`` by descending score, and the gallery's size N.
        """
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise InvalidParameterError(f"k must be an integer >= 1, got {k!r}", detail={"field": "k"})
        entry = self._entry(gallery)
        q = np.asarray(queries)
        if q.ndim != 2 or q.shape[0] < 1 or not np.issubdtype(q.dtype, np.floating):
            raise InvalidParameterError(
                f"queries must be a non-empty (Q, D) float array, got shape {q.shape}", detail={"field": "queries"}
            )
        if q.shape[1] != entry.dim:
            raise DimensionMismatchError(
                f"query dimension {q.shape[1]} does not match gallery {gallery!r} ({entry.dim})",
                detail={"expected": entry.dim, "got": int(q.shape[1])},
            )
        if not np.isfinite(q).all():
            raise InvalidParameterError("queries contain NaN or inf", detail={"field": "queries"})
        q64 = q.astype(np.float64)
        qn = (q64 / np.maximum(np.linalg.norm(q64, axis=1, keepdims=True), 1e-12)).astype(np.float32)
        with entry.lock:
            n = entry.n
            if n == 0:
                return [([], np.zeros(0, np.float32)) for _ in range(q.shape[0])], 0
            kk = min(int(k), n)
            vals, rows = self._ops.topk(qn, entry.mat[:n], kk)
            ids = [[entry.ids[int(j)] for j in row] for row in rows]
        return [(i, v.astype(np.float32)) for i, v in zip(ids, vals, strict=True)], n

    def search(self, gallery: str, queries: np.ndarray, k: int, threshold: float) -> list[list[SearchHit]]:
        """:meth:`search_raw` as :class:`SearchHit` lists, ``match = score >= threshold``."""
        thr = float(threshold)
        hits, _ = self.search_raw(gallery, queries, k)
        return [
            [SearchHit(sid, float(v), bool(v >= thr)) for sid, v in zip(ids_row, v_row, strict=True)]
            for ids_row, v_row in hits
        ]

    def __repr__(self) -> str:
        return f"GalleryIndex(device={self.device}, dtype={self.dtype}, galleries={self.sizes()})"
