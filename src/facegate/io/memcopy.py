"""Copies of small arrays that keep the GIL, for the serving processes' hot threads: numpy releases it around
larger copies, and winning it back can take the 1 ms switch interval; a ``memoryview`` slice assignment is one
``memcpy`` with the GIL held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Payloads up to this many bytes are copied with the GIL held.
GIL_COPY_MAX_BYTES = 8 * 2**20


def _byte_view(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr)).cast("B")


def copy_out(buf: memoryview, offset: int, shape: Sequence[int], dtype: np.dtype | str) -> np.ndarray:
    """A writable copy of the ``shape``/``dtype`` array stored at ``buf[offset:]`` (e.g. a shared-memory
    block), made with the GIL held when it is at most :data:`GIL_COPY_MAX_BYTES`."""
    dt = np.dtype(dtype)
    nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
    if nbytes > GIL_COPY_MAX_BYTES:
        return np.ndarray(tuple(shape), dt, buffer=buf, offset=offset).copy()
    return np.frombuffer(bytearray(buf[offset : offset + nbytes]), dt).reshape(tuple(shape))


def copy_in(buf: memoryview, offset: int, arr: np.ndarray) -> None:
    """Write ``arr`` (any layout; stored C-contiguous) into ``buf[offset:]``, with the GIL held when small."""
    if arr.nbytes > GIL_COPY_MAX_BYTES or not arr.size:
        np.ndarray(arr.shape, arr.dtype, buffer=buf, offset=offset)[...] = arr
        return
    src = _byte_view(arr)
    buf[offset : offset + len(src)] = src


def pack_rows(out: np.ndarray, parts: Sequence[np.ndarray]) -> int:
    """``np.concatenate(parts, out=out[:n])`` into C-contiguous ``out``, a ``memcpy`` per small part; returns ``n``.
    The caller checks that the parts have ``out``'s dtype and row shape and fit in it."""
    dst = memoryview(out).cast("B")
    row_bytes = out.itemsize * int(np.prod(out.shape[1:], dtype=np.int64))
    rows = 0
    for p in parts:
        if not len(p):
            continue
        if p.nbytes > GIL_COPY_MAX_BYTES:
            out[rows : rows + len(p)] = p
        else:
            dst[rows * row_bytes : (rows + len(p)) * row_bytes] = _byte_view(p)
        rows += len(p)
    return rows
