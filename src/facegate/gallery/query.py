"""The search request and answer that cross the front-end ↔ engine boundary (torch-free).

A request travels as one ``uint8`` array, on the same shared-memory transport as photos and crops: a fixed
:data:`HEADER` (magic, ``k``, the gallery name), then the ``(D,) float32`` query or the encoded photo's bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from facegate.errors import InvalidParameterError
from facegate.gallery.base import validate_gallery_name

#: ``magic, k, name length, name`` (little-endian, 76 bytes with padding).
HEADER = struct.Struct("<4sIH64sxx")
_MAGIC, _PHOTO_MAGIC = b"FGSQ", b"FGPS"


def _encode(magic: bytes, gallery: str, k: int, body: bytes) -> np.ndarray:
    name = validate_gallery_name(gallery).encode("ascii")
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise InvalidParameterError(f"k must be an integer >= 1, got {k!r}", detail={"field": "k"})
    return np.frombuffer(HEADER.pack(magic, int(k), len(name), name) + body, np.uint8)


def _decode(magic: bytes, buf: np.ndarray) -> tuple[str, int, np.ndarray]:
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


def decode_photo_search(buf: np.ndarray) -> tuple[str, int, np.ndarray]:
    """Inverse of :func:`encode_photo_search`: ``(gallery, k, (n,) uint8 photo bytes)``."""
    return _decode(_PHOTO_MAGIC, buf)


@dataclass(frozen=True, slots=True)
class SearchOut:
    """The engine's answer to one query: the top ``k`` ``subject_ids`` (fewer when the gallery is smaller),
    their ``(len,) float32`` cosine ``scores`` descending, the gallery's ``size`` N when searched (the FPIR
    of a threshold depends on it) and the change-feed ``seq`` the index was current at."""

    subject_ids: list[str]
    scores: np.ndarray = field(compare=False)
    size: int
    seq: int
