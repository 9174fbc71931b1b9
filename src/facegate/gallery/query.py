"""The search request and answer that cross the front-end ↔ engine boundary (torch-free).

A request travels as one ``uint8`` array, so it rides the same shared-memory transport as photos and
crops: a fixed :data:`HEADER` (magic, ``k``, the gallery name) followed by the ``(D,) float32`` query.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from facegate.errors import InvalidParameterError
from facegate.gallery.base import validate_gallery_name

#: ``magic, k, name length, name`` (little-endian, 76 bytes with padding), then the query's float32 values.
HEADER = struct.Struct("<4sIH64sxx")
_MAGIC = b"FGSQ"


def encode_search(gallery: str, query: np.ndarray, k: int) -> np.ndarray:
    """One search request as a ``uint8`` array: gallery name, ``k >= 1`` and a ``(D,) float32`` query."""
    name = validate_gallery_name(gallery).encode("ascii")
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise InvalidParameterError(f"k must be an integer >= 1, got {k!r}", detail={"field": "k"})
    q = np.ascontiguousarray(query, dtype="<f4").reshape(-1)
    head = HEADER.pack(_MAGIC, int(k), len(name), name)
    return np.frombuffer(head + q.tobytes(), np.uint8)


def decode_search(buf: np.ndarray) -> tuple[str, int, np.ndarray]:
    """Inverse of :func:`encode_search`: ``(gallery, k, (D,) float32 query)``."""
    raw = np.ascontiguousarray(buf, np.uint8).tobytes()
    if len(raw) < HEADER.size + 4 or (len(raw) - HEADER.size) % 4:
        raise InvalidParameterError("malformed search request", detail={"bytes": len(raw)})
    magic, k, n, name = HEADER.unpack_from(raw)
    if magic != _MAGIC or n > len(name):
        raise InvalidParameterError("malformed search request header")
    return name[:n].decode("ascii"), int(k), np.frombuffer(raw, "<f4", offset=HEADER.size).astype(np.float32)


@dataclass(frozen=True, slots=True)
class SearchOut:
    """What the engine's search stage answers for one query.

    Attributes:
        subject_ids: the top ``k`` (fewer when the gallery is smaller), best first.
        scores: ``(len(subject_ids),) float32`` cosine similarities, descending.
        size: the gallery's number of subjects N when it was searched (the FPIR of a threshold depends on it).
        seq: the change-feed sequence number the index was current at.
    """

    subject_ids: list[str]
    scores: np.ndarray = field(compare=False)
    size: int
    seq: int


_PHOTO_MAGIC = b"FGPS"


def encode_photo_search(gallery: str, data: bytes, k: int) -> np.ndarray:
    """A photo search request as one ``uint8`` array: gallery name, ``k`` and the encoded photo's bytes."""
    name = validate_gallery_name(gallery).encode("ascii")
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise InvalidParameterError(f"k must be an integer >= 1, got {k!r}", detail={"field": "k"})
    return np.frombuffer(HEADER.pack(_PHOTO_MAGIC, int(k), len(name), name) + bytes(data), np.uint8)


def decode_photo_search(buf: np.ndarray) -> tuple[str, int, np.ndarray]:
    """Inverse of :func:`encode_photo_search`: ``(gallery, k, (n,) uint8 photo bytes)``."""
    arr = np.ascontiguousarray(buf, np.uint8)
    if arr.size < HEADER.size:
        raise InvalidParameterError("malformed photo search request", detail={"bytes": int(arr.size)})
    magic, k, n, name = HEADER.unpack_from(arr[: HEADER.size].tobytes())
    if magic != _PHOTO_MAGIC or n > len(name):
        raise InvalidParameterError("malformed photo search request header")
    return name[:n].decode("ascii"), int(k), arr[HEADER.size :]
