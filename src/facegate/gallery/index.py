"""Exact 1:N cosine search over every gallery's templates: NumPy BLAS on the CPU, torch on an accelerator.

Per gallery a ``(capacity, D)`` matrix holds the unit-norm templates in rows ``[0, n)`` (zero beyond), the
ids in row order and an ``id -> row`` dict. An upsert overwrites or appends a row (doubling a full buffer);
a remove moves the last row into the hole (halving a buffer under a quarter full). A search is one matrix
product ``(Q, D) @ (D, n)`` and one top-k, under the gallery's lock (so it never sees a half-applied write).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from facegate.errors import DimensionMismatchError, GalleryError, GalleryNotFoundError, InvalidParameterError

#: Smallest buffer, in rows; buffers above :data:`ALIGN` rows are a multiple of it (so blocks tile them).
_MIN_CAPACITY = 64
ALIGN = 4096
BLOCK_MIN = 65_536  # galleries above this many rows take the two-level top-k on torch
_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _mismatch(what: str, got: object, expected: object) -> DimensionMismatchError:
    return DimensionMismatchError(
        f"{what}: got {got}, expected dimension {expected}", detail={"expected": expected, "got": got}
    )


class _NumpyOps:
    """Template matrices as NumPy arrays (CPU, float32/float64). The matrix product runs on half the cores'
    worth of BLAS threads: the model stages use the rest, and BLAS threads spinning on a busy core stall."""

    _blas: Any = None  # one threadpoolctl controller per process

    def __init__(self, dtype: str) -> None:
        from threadpoolctl import ThreadpoolController

        self.dtype = np.dtype(dtype)
        self.threads = max(1, (os.cpu_count() or 1) // 2)
        if _NumpyOps._blas is None:
            _NumpyOps._blas = ThreadpoolController()

    def zeros(self, rows: int, dim: int) -> np.ndarray:
        return np.zeros((rows, dim), self.dtype)

    def from_numpy(self, arr: np.ndarray) -> np.ndarray:
        return np.asarray(arr, self.dtype)

    def topk(self, q: np.ndarray, mat: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(Q, k)`` scores, descending, and ``(Q, k) int64`` rows of ``mat[:n]``."""
        with self._blas.limit(limits=self.threads, user_api="blas"):
            scores = self.from_numpy(q) @ mat[:n].T
        idx = np.argpartition(scores, n - k, axis=1)[:, n - k :] if k < n else np.argsort(-scores, axis=1)
        vals = np.take_along_axis(scores, idx, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        return np.take_along_axis(vals, order, axis=1), np.take_along_axis(idx, order, axis=1)


class _TorchOps:
    """Template matrices as torch tensors on ``device``. Above :data:`BLOCK_MIN` rows the top-k is exact and
    two-level (cheaper than one ``torch.topk`` over millions of columns): the top ``k`` blocks of ``block`` scores
    by their maximum, then the top ``k`` of those blocks' scores. ``block``: a divisor of :data:`ALIGN`; 0: off;
    None: 2,048-4,096 blocks."""

    def __init__(self, device: Any, dtype: str, block: int | None = None) -> None:
        import torch

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.block = block
        self._pin = self.device.type == "cuda"
        self._local = threading.local()  # per search thread: its host buffers
        self._offsets: dict[int, Any] = {}  # b -> arange(b) on the device

    def zeros(self, rows: int, dim: int) -> Any:
        # never an inference tensor: the feed thread writes into it outside inference mode
        with self.torch.inference_mode(False):
            return self.torch.zeros((rows, dim), dtype=self.dtype, device=self.device)

    def from_numpy(self, arr: np.ndarray) -> Any:
        with self.torch.inference_mode(False):
            return self.torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(self.device, self.dtype)

    def _host(self, name: str, rows: int, cols: int) -> Any:
        """This thread's reused ``(rows, cols) float32`` host buffer ``name``, pinned on CUDA (asynchronous copies)."""
        if (buf := getattr(self._local, name, None)) is None or buf.numel() < rows * cols:
            setattr(self._local, name, buf := self.torch.empty(max(rows * cols, 4096), pin_memory=self._pin))
        return buf[: rows * cols].view(rows, cols)

    def launch(self, qd: Any, mat: Any, n: int, k: int) -> Any:
        """Queue the top-``k`` of ``(Q, D)`` device queries ``qd`` (any float dtype, normalised here) against
        ``mat[:n]`` without waiting: ``(Q, 2k) float32``, the scores then the int32 rows reinterpreted as float32
        (one device->host copy brings both)."""
        torch, b = self.torch, self.block
        if b is None:
            b = min(ALIGN, max(256, 1 << (n // 4096).bit_length()))
        qd = qd.float()
        qd = (qd / qd.norm(dim=1, keepdim=True).clamp_min(1e-12)).to(self.dtype)
        if b and n > BLOCK_MIN:
            blocks = -(-n // b)
            scores = qd @ mat[: blocks * b].T  # (Q, blocks * b): rows past n are zero, masked below
            scores[:, n:] = -torch.inf
            best = scores.view(len(qd), blocks, b).amax(dim=2).topk(min(k, blocks), dim=1, sorted=False).indices
            if (offsets := self._offsets.get(b)) is None:
                offsets = self._offsets[b] = torch.arange(b, device=self.device)
            cand = (best.unsqueeze(2) * b + offsets).flatten(1)  # (Q, k * b)
            vals, j = torch.topk(scores.gather(1, cand), k, dim=1)
            rows = cand.gather(1, j)
        else:
            vals, rows = torch.topk(qd @ mat[:n].T, k, dim=1)
        return torch.cat((vals.float(), rows.int().view(torch.float32)), dim=1)

    def topk(self, q: np.ndarray, mat: Any, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        torch = self.torch
        with torch.inference_mode():
            qd = self._host("q", *q.shape).copy_(torch.from_numpy(q)).to(self.device, non_blocking=True)
            packed = self.launch(qd, mat, n, k)
            host = self._host("out", *packed.shape).copy_(packed, non_blocking=self._pin)
            if self._pin:
                torch.cuda.current_stream(self.device).synchronize()
            packed = host.numpy().copy()  # the buffer is reused by this thread's next search
        return packed[:, :k], packed[:, k:].view(np.int32)


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


def _named(entry: _Entry, vals: np.ndarray, rows: np.ndarray) -> tuple[list[tuple[list[str], np.ndarray]], int]:
    """:meth:`GalleryIndex.search_raw`'s answer from ``(Q, k)`` scores and rows of ``entry`` (under its lock)."""
    k = rows.shape[1]
    names = list(map(entry.ids.__getitem__, rows.ravel().tolist()))
    return [(names[i * k : (i + 1) * k], v) for i, v in enumerate(vals)], entry.n


class GalleryIndex:
    """Exact cosine top-k over every gallery's templates, on ``device`` (``"cpu"``, ``"cuda"``, a
    ``torch.device``), stored as ``dtype`` (a name or a torch dtype): ``float32``, ``float64``, or
    ``float16``/``bfloat16`` (half the memory, ~1e-3 score error). NumPy on the CPU in float32/float64."""

    def __init__(self, device: Any = "cpu", dtype: Any = "float32") -> None:
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise InvalidParameterError(f"unsupported index dtype {dtype}", detail={"field": "dtype"})
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

    def _entry(self, gallery: str) -> _Entry:
        if (entry := self.entry(gallery)) is None:
            raise GalleryNotFoundError(f"gallery {gallery!r} is not in the search index", detail={"gallery": gallery})
        return entry

    def _alloc(self, rows: int, dim: int) -> Any:
        rows = max(rows, _MIN_CAPACITY)
        rows = rows if rows <= ALIGN else -(-rows // ALIGN) * ALIGN
        try:
            return self._ops.zeros(rows, dim)
        except (RuntimeError, MemoryError) as exc:  # e.g. CUDA OOM
            raise GalleryError(f"cannot allocate a {rows}x{dim} gallery index on {self.device}: {exc}") from exc

    def _resize(self, entry: _Entry, rows: int) -> None:
        mat = self._alloc(rows, entry.dim)
        mat[: entry.n] = entry.mat[: entry.n]
        entry.mat = mat

    def _make_entry(self, dim: int, ids: list[str], templates: np.ndarray) -> _Entry:
        templates = np.asarray(templates, dtype=np.float32)
        if templates.shape != (len(ids), dim):
            raise _mismatch(f"templates of {len(ids)} ids", list(templates.shape), dim)
        mat = self._alloc(len(ids), dim)
        mat[: len(ids)] = self._ops.from_numpy(templates)
        return _Entry(dim=dim, mat=mat, ids=list(ids), pos={s: i for i, s in enumerate(ids)})

    @property
    def on_torch(self) -> bool:
        """Whether the templates are torch tensors (then :meth:`launch` works)."""
        return isinstance(self._ops, _TorchOps)

    def entry(self, gallery: str) -> _Entry | None:
        """The gallery's entry as an identity token (a re-created gallery gets a new one), or None."""
        with self._guard:
            return self._entries.get(gallery)

    def ensure_gallery(self, gallery: str, dim: int) -> None:
        """Add an empty gallery of dimension ``dim``: a no-op when present with that dim, a fresh one in place of a
        gallery of another dim (deleted and re-created under this name)."""
        with self._guard:
            entry = self._entries.get(gallery)
            if entry is None or entry.dim != dim:
                self._entries[gallery] = self._make_entry(dim, [], np.zeros((0, dim), np.float32))

    def load_all(self, galleries: dict[str, tuple[int, list[str], np.ndarray]]) -> None:
        """Replace every gallery at once: ``{name: (dim, subject_ids, (S, D) float32 templates)}``."""
        fresh = {name: self._make_entry(int(dim), ids, t) for name, (dim, ids, t) in galleries.items()}
        with self._guard:
            self._entries = fresh

    def drop(self, gallery: str) -> None:
        """Forget a gallery (no-op when absent)."""
        with self._guard:
            self._entries.pop(gallery, None)

    def upsert(self, gallery: str, subject_id: str, template: np.ndarray) -> None:
        """Insert or overwrite one subject's template ``(D,) float32`` (unit norm)."""
        entry = self._entry(gallery)
        vec = np.asarray(template, dtype=np.float32)
        if vec.shape != (entry.dim,):
            raise _mismatch(f"a template for {gallery!r}", list(vec.shape), entry.dim)
        row = self._ops.from_numpy(vec)
        with entry.lock:
            if (i := entry.pos.get(subject_id)) is None:
                i = entry.n
                if i == entry.mat.shape[0]:
                    self._resize(entry, 2 * i)
                entry.ids.append(subject_id)
                entry.pos[subject_id] = i
            entry.mat[i] = row

    def remove(self, gallery: str, subject_id: str) -> bool:
        """Remove one subject (swap-remove); returns whether it was present."""
        entry = self._entry(gallery)
        with entry.lock:
            if (i := entry.pos.pop(subject_id, None)) is None:
                return False
            last = entry.n - 1
            if i != last:
                entry.mat[i] = entry.mat[last]
                entry.ids[i] = entry.ids[last]
                entry.pos[entry.ids[i]] = i
            entry.ids.pop()
            entry.mat[last] = 0
            if entry.mat.shape[0] > _MIN_CAPACITY and entry.n < entry.mat.shape[0] // 4:
                self._resize(entry, 2 * entry.n)
            return True

    def sizes(self) -> dict[str, int]:
        """``{gallery: number of subjects}`` of every loaded gallery."""
        with self._guard:
            return {name: e.n for name, e in sorted(self._entries.items())}

    def search_raw(self, gallery: str, queries: np.ndarray, k: int) -> tuple[list[tuple[list[str], np.ndarray]], int]:
        """Exact cosine top-k of ``(Q, D)`` float ``queries`` (normalised here) with ``k >= 1`` hits each (fewer
        in a smaller gallery): per query ``(subject_ids, (k,) float32 scores)`` by descending score, and N."""
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise InvalidParameterError(f"k must be an integer >= 1, got {k!r}", detail={"field": "k"})
        entry = self._entry(gallery)
        q = np.asarray(queries)
        if q.ndim != 2 or q.shape[0] < 1 or not np.issubdtype(q.dtype, np.floating) or not np.isfinite(q).all():
            raise InvalidParameterError(
                f"queries must be a non-empty (Q, D) array of finite floats, got shape {q.shape}",
                detail={"field": "queries"},
            )
        if q.shape[1] != entry.dim:
            raise _mismatch(f"queries for {gallery!r}", int(q.shape[1]), entry.dim)
        q = q.astype(np.float32)
        q /= np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
        with entry.lock:
            if entry.n == 0:
                return [([], np.zeros(0, np.float32)) for _ in q], 0
            vals, rows = self._ops.topk(q, entry.mat, entry.n, min(int(k), entry.n))
            return _named(entry, vals.astype(np.float32, copy=False), rows)

    def launch(self, gallery: str, queries: Any, k: int, hold: contextlib.ExitStack) -> tuple[Any, Any]:
        """Queue the exact top-``k`` of ``(Q, D)`` float ``queries`` already on this (torch) index's device
        without waiting, so that they share one device->host copy with other results. The gallery's lock is
        held in ``hold`` until it closes: no row may move before the answer is read.

        Returns ``(packed, finish)``: ``packed`` the ``(Q, 2k') float32`` device tensor and ``finish(host)``, which
        turns its host copy into :meth:`search_raw`'s answer; ``(None, None)`` for an empty gallery."""
        entry = self._entry(gallery)
        if queries.shape[1] != entry.dim:
            raise _mismatch(f"queries for {gallery!r}", int(queries.shape[1]), entry.dim)
        hold.enter_context(entry.lock)
        if entry.n == 0:
            return None, None
        kk = min(int(k), entry.n)
        packed = self._ops.launch(queries, entry.mat, entry.n, kk)  # a torch index: the caller checks on_torch
        return packed, lambda host: _named(entry, host[:, :kk], host[:, kk:].view(np.int32))
