"""What the engine stages return across processes, each pickled as one float32 block; torch-free for the front-ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from facegate.types import Detection

#: Columns of a packed face besides its embedding (:meth:`PhotoFaces.pack`).
PACKED_EXTRA = 23


class EmbedOut(tuple):  # type: ignore[type-arg]
    """``(embedding (k, D), quality (k,), raw (k,))`` float32: three views of one ``(k, D+2)`` block, pickled as that
    one contiguous block (pickling results is most of the engine's sender thread's work)."""

    block: np.ndarray

    def __new__(cls, block: np.ndarray) -> EmbedOut:
        d = block.shape[1] - 2
        out = super().__new__(cls, (block[:, :d], block[:, d], block[:, d + 1]))
        out.block = block
        return out

    def __reduce__(self) -> tuple[type[EmbedOut], tuple[np.ndarray]]:
        return EmbedOut, (np.ascontiguousarray(self.block),)


@dataclass(frozen=True, slots=True)
class PhotoFaces:
    """The selected faces of one photo: ``embedding (k, D)``, ``quality``/``raw`` ``(k,)`` and ``stats (k, 3)``
    (:func:`~facegate.quality_reasons.crop_stats`), all float32."""

    detections: Sequence[Detection | None]
    embedding: np.ndarray
    quality: np.ndarray
    raw: np.ndarray
    stats: np.ndarray

    def pack(self) -> np.ndarray:
        """``(k, D + 23) float32``: per face embedding, quality, raw, has-detection, box, landmarks, score, stats,
        photo width and height (0: unknown; every field is float32 already or a photo size float32 holds exactly, so
        :func:`unpack_photo_faces` rebuilds an equal object)."""
        k, d = self.embedding.shape
        out = np.zeros((k, d + PACKED_EXTRA), np.float32)
        out[:, :d] = self.embedding
        out[:, d], out[:, d + 1] = self.quality, self.raw
        for r, det in enumerate(self.detections):
            if det is not None:
                out[r, d + 2] = 1.0
                out[r, d + 3 : d + 7] = det.box
                out[r, d + 7 : d + 17] = det.landmarks.reshape(10)
                out[r, d + 17] = det.score
                out[r, d + 21 :] = det.photo_wh or (0, 0)
        out[:, d + 18 : d + 21] = self.stats
        return out

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        """Pickled as one array: a tree of objects holds the engine process's GIL longer."""
        return unpack_photo_faces, (self.pack(),)


def unpack_photo_faces(packed: np.ndarray) -> PhotoFaces:
    """The inverse of :meth:`PhotoFaces.pack`."""
    d = packed.shape[1] - PACKED_EXTRA
    dets: list[Detection | None] = [
        Detection(
            box=r[d + 3 : d + 7].copy(),
            landmarks=r[d + 7 : d + 17].reshape(5, 2).copy(),
            score=float(r[d + 17]),
            photo_wh=(int(r[d + 21]), int(r[d + 22])) if r[d + 21] > 0 else None,
        )
        if r[d + 2]
        else None
        for r in packed
    ]
    return PhotoFaces(
        dets, packed[:, :d].copy(), packed[:, d].copy(), packed[:, d + 1].copy(), packed[:, d + 18 : d + 21].copy()
    )
