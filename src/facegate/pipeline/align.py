"""Five-point face alignment: similarity estimation (NumPy) and warping on the CPU (OpenCV).

:mod:`facegate.pipeline.align_torch` warps the same way in torch (apart, so that front-ends never import torch).
Shared conventions: pixel centres at integers (OpenCV's); ``M`` is a ``(2, 3)`` source→crop matrix; samples
outside the source read zeros (as insightface's ``norm_crop``), so images may be zero-padded at the bottom and
right, never top/left; landmark order as :mod:`facegate.types`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import cv2
import numpy as np

from facegate.errors import InvalidParameterError

#: Crop side length the ArcFace template is defined for.
CROP_SIZE = 112

#: ``(5, 2) float32`` ArcFace landmark template for a 112×112 crop, YuNet landmark order.
ARCFACE_TEMPLATE: np.ndarray = np.array(
    [
        [38.2946, 51.6963],  # right eye (image left)
        [73.5318, 51.5014],  # left eye
        [56.0252, 71.7366],  # nose tip
        [41.5493, 92.3655],  # right mouth corner
        [70.7299, 92.2041],  # left mouth corner
    ],
    dtype=np.float32,
)
ARCFACE_TEMPLATE.setflags(write=False)

_DEGENERATE_VAR = 1e-12


def similarity_matrices(src: Any, dst: Any, tiny: float, stack: Callable[..., Any]) -> Any:
    """Umeyama's least-squares similarity (never a reflection) by its 2-D closed form, on NumPy arrays or torch
    tensors alike (``stack``: ``np.stack`` or ``torch.stack``): ``src``, ``dst`` ``(N, P, 2)`` float → ``(N, 2, 3)``
    with ``dst ≈ M[:, :2] @ src + M[:, 2]``. ``tiny`` is added to the source's spread: coincident points give a zero
    linear part."""
    mu_s, mu_d = src.mean(1), dst.mean(1)
    sc, dc = src - mu_s[:, None, :], dst - mu_d[:, None, :]
    norm = (sc * sc).sum((1, 2)) + tiny
    a = (sc * dc).sum((1, 2)) / norm
    b = (sc[..., 0] * dc[..., 1] - sc[..., 1] * dc[..., 0]).sum(1) / norm
    tx = mu_d[:, 0] - (a * mu_s[:, 0] - b * mu_s[:, 1])
    ty = mu_d[:, 1] - (b * mu_s[:, 0] + a * mu_s[:, 1])
    return stack([stack([a, -b, tx], 1), stack([b, a, ty], 1)], 1)


def umeyama(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Least-squares similarity transforms (Umeyama 1991, never a reflection) of ``src`` ``(N, P, 2)`` onto
    ``dst`` ``(P, 2)`` or ``(N, P, 2)``: ``(N, 2, 3) float64`` with ``dst ≈ M[:, :2] @ src + M[:, 2]``
    (:func:`similarity_matrices`). InvalidParameterError for wrong shapes, non-finite or coincident points."""
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    if src.ndim != 3 or src.shape[2] != 2 or src.shape[1] < 2:
        raise InvalidParameterError(
            f"src must have shape (N, P>=2, 2), got {src.shape}", detail={"shape": list(src.shape)}
        )
    if dst.shape not in {src.shape[1:], src.shape}:
        raise InvalidParameterError(
            f"dst must have shape {src.shape[1:]} or {src.shape}, got {dst.shape}",
            detail={"shape": list(dst.shape)},
        )
    bad = ~np.isfinite(src).all(axis=(1, 2)) | ~(src.var(axis=1).sum(axis=1) > _DEGENERATE_VAR)
    if bad.any():
        idx = np.flatnonzero(bad).tolist()
        raise InvalidParameterError(
            f"{len(idx)} landmark set(s) are non-finite or all points coincide; no similarity exists",
            detail={"indices": idx[:50]},
        )
    return similarity_matrices(src, np.broadcast_to(dst, src.shape), 0.0, np.stack)


def estimate_transforms(landmarks: np.ndarray) -> np.ndarray:
    """``(N, 2, 3) float32`` source→crop matrices taking ``landmarks`` ``(N, 5, 2)`` onto :data:`ARCFACE_TEMPLATE`
    (:func:`umeyama` refuses other shapes)."""
    return umeyama(landmarks, ARCFACE_TEMPLATE).astype(np.float32)


def warp_cpu(image: np.ndarray, M: np.ndarray) -> np.ndarray:
    """``image`` ``(H, W, 3) uint8`` → ``(112, 112, 3) uint8`` by ``M`` ``(2, 3)``: bilinear, zeros outside."""
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise InvalidParameterError(
            "image must be an (H, W, 3) uint8 array",
            detail={"shape": list(getattr(image, "shape", ())), "dtype": str(getattr(image, "dtype", ""))},
        )
    m = np.asarray(M, dtype=np.float64)
    try:
        return cv2.warpAffine(
            np.ascontiguousarray(image), m, (CROP_SIZE, CROP_SIZE), flags=cv2.INTER_LINEAR, borderValue=0
        )
    except cv2.error as exc:  # e.g. an M that is not (2, 3)
        raise InvalidParameterError(f"cv2.warpAffine failed: {exc}", detail={"shape": list(image.shape)}) from exc


def align_cpu(images: Sequence[np.ndarray], landmarks: np.ndarray, image_index: Sequence[int]) -> np.ndarray:
    """``(K, 112, 112, 3) uint8`` crops of faces ``landmarks`` ``(K, 5, 2)``, face ``k`` in
    ``images[image_index[k]]`` (``(H, W, 3) uint8`` each, sizes may differ); ``image_index`` ``(K,)`` int is the
    caller's own bookkeeping (a wrong length raises ValueError, an index out of range IndexError)."""
    mats = estimate_transforms(landmarks)
    out = np.empty((len(mats), CROP_SIZE, CROP_SIZE, 3), np.uint8)
    for j, (i, m) in enumerate(zip(image_index, mats, strict=True)):
        out[j] = warp_cpu(images[int(i)], m)
    return out


def is_aligned_crop(image: np.ndarray) -> bool:
    """Whether ``image`` is treated as a pre-aligned crop (skips detection): exactly ``(112, 112, 3)``."""
    return tuple(getattr(image, "shape", ())) == (CROP_SIZE, CROP_SIZE, 3)
